"""Bodies of the ``hetrain`` sub-commands, one module each, imported lazily by
:mod:`hetrain.cli` so that ``plan``/``evaluate``/``simulate`` never import torch."""
