"""Target runtime speed-ups that keep the target's arithmetic.

Modules:
    packed -- the target's linear layers through oneDNN with weights pre-packed once
              (``--linear-backend onednn``), chosen against PyTorch's default (``aten``)
              by measuring the target's one-token step and a 16-token verification on
              this machine (``auto``; :mod:`dspine.tune`).
"""
