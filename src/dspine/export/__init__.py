"""Drafters in the formats serving engines read (`dspine export`).

:mod:`dspine.export.dflash` writes and reads the z-lab DFlash folder (vLLM, and llama.cpp
after conversion); :mod:`dspine.export.engines` writes the target as engines load it and
runs llama.cpp's GGUF converter; :mod:`dspine.export.cli` is the command.
"""
