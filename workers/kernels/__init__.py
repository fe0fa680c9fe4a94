"""Hand-written CPU kernels for the engine's hot path (built with the system C compiler on first
use, with a torch fallback): :mod:`workers.kernels.packed_linear`."""
