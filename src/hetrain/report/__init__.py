"""Human-readable reports: rich tables (:mod:`hetrain.report.tables`) and plots."""
