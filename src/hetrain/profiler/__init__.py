"""Profiling of real modules (needs torch): FLOPs and bytes per layer of a chain
(:func:`profile_chain`), layer timing and the fit of speed and κ (:func:`time_layers`,
:func:`fit_device`), stage timing and the fit of speed, κ and λ (:func:`time_stages`,
:func:`fit_stages`), point-to-point link measurement (:func:`measure_p2p`)."""

from hetrain.profiler.chain import MetaModelMode, profile_chain, profile_on_meta
from hetrain.profiler.link import LinkFit, measure_p2p
from hetrain.profiler.timing import (
    DeviceFit,
    LayerTimes,
    StageTimes,
    fit_device,
    fit_stages,
    time_layers,
    time_stages,
)

__all__ = [
    "DeviceFit",
    "LayerTimes",
    "LinkFit",
    "StageTimes",
    "fit_device",
    "fit_stages",
    "measure_p2p",
    "MetaModelMode",
    "profile_chain",
    "profile_on_meta",
    "time_layers",
    "time_stages",
]
