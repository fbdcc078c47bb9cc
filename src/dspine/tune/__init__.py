"""Measured, cached choices of hardware-dependent settings.

Kernels differ by up to ~60x between CPUs (``torch._int_mm`` is fast with VNNI/AMX and
crawls on AVX2-only CPUs), so nothing here is hard-coded for one CPU: each choice is
timed on the machine at hand the first time it matters, stored under
``$DSPINE_HOME/tune/`` keyed by the machine (CPU model, instruction-set flags, torch
version, threads) and the shapes, and reused afterwards.

Modules:
    machine  -- the machine fingerprint (CPU model, ISA class, torch, threads).
    store    -- the JSON cache of measurements and choices.
    choose   -- timing and choosing among alternatives (injectable timer for tests).
    head     -- the drafter's candidate pass: int8 ``_int_mm``, bfloat16 or exact head.
    dtype    -- the target's dtype for batched forwards (data build, feature store).
    cli      -- ``dspine tune``: print the measured table and choices, or redo them.
"""
