"""dspine: lossless speculative decoding with DSpine block-parallel drafters."""
import os as _os

__version__ = "0.1.0"

# DSPINE_CPU_ISA=avx2|avx512 caps the instruction set of every kernel (dspine.tune.machine):
# PyTorch's and oneDNN's read their own variables once, at first use, so they are set here,
# before any tensor op, unless the user set them.
_CAPS = {"avx2": ("avx2", "AVX2"), "avx512": ("avx512", "AVX512_CORE")}
_cap = _os.environ.get("DSPINE_CPU_ISA", "").strip().lower()
if _cap in _CAPS:
    _os.environ.setdefault("ATEN_CPU_CAPABILITY", _CAPS[_cap][0])
    _os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _CAPS[_cap][1])
