"""dspine: lossless speculative decoding with DSpine block-parallel drafters."""
__version__ = "0.1.0"
