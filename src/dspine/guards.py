"""Start-time guards: refuse every setting the runtime has not validated (spec section 8).

The released serving path accepts only a narrow configuration and refuses the rest
with an error naming the setting. This module does the same for the dspine runtime:
:func:`validate_runtime` is called once at start (``dspine.cli.main.build_engine``; a
server calls it with its concurrency) and raises :class:`GuardError` with one line
naming the setting, the value given and the accepted values. The table in
``docs/validated.md`` lists the same settings (:data:`VALIDATED` is its source).

Checks:

- ``device``: ``cpu`` or ``cuda`` (``cuda:N``), and CUDA must be available.
- ``dtype`` (drafter weights and activations; the CLI uses it for the target too):
  ``float32`` or ``bfloat16`` (float16 and others are refused: no kernel path or
  exactness test covers them).
- target dtype: ``float32`` or ``bfloat16``.
- ``block_size``: equal to the drafter checkpoint's block size.
- ``concurrency``: 1..8 requests (the release's validated limit).
- target output head: unquantized, floating point (float32/bfloat16), contiguous;
  the drafter shares it (final-stage candidates and conditional tables, or the
  continuous logits) and the coarse pass quantizes its own copy from it.
- recurrent state dtype of hybrid (linear-attention) targets: ``float32`` only.
- tensor / pipeline parallel size 1; KV cache dtype ``auto`` (the target's dtype);
  no FP4/FP8 KV formats, no prefill/decode disaggregation.
"""
from __future__ import annotations

import os

import torch

from dspine.config import ConfigError

MAX_CONCURRENCY = 8
DEVICES = ("cpu", "cuda")
DRAFTER_DTYPES = ("float32", "bfloat16")
TARGET_DTYPES = ("float32", "bfloat16")
STATE_DTYPES = ("float32",)
KV_CACHE_DTYPES = ("auto",)
#: config fields of recurrent targets that set the state dtype (as dspine.target.hybrid_arch reads them)
STATE_DTYPE_FIELDS = ("recurrent_state_dtype", "mamba_ssm_dtype", "mamba_ssm_cache_dtype", "ssm_state_dtype")

#: (setting, accepted values, why) — the source of docs/validated.md.
VALIDATED: list[tuple[str, str, str]] = [
    ("device (`--device`)", "`cpu`, `cuda` / `cuda:N` (CUDA available)",
     "the only backends the runtime and its tests run on"),
    ("drafter dtype (`--dtype`)", "`float32`, `bfloat16`",
     "exactness tests run in float32, the release in bfloat16; float16 has no validated kernel path"),
    ("target dtype (`--dtype`)", "`float32`, `bfloat16`", "as the drafter"),
    ("block size (`--block-size`)", "the drafter checkpoint's block size (release: 16)",
     "a drafter runs only at its trained block size"),
    ("concurrency", f"1 .. {MAX_CONCURRENCY} requests", "the release's validated limit"),
    ("target output head", "unquantized, float32/bfloat16, contiguous",
     "shared by the drafter (final stage candidates and conditional tables, continuous logits)"),
    ("recurrent state dtype (hybrid targets)", "`float32`",
     "ReplaySSM replays the recurrence exactly only in float32 (spec s.6)"),
    ("tensor parallel size", "1", "no sharded runtime"),
    ("pipeline parallel size", "1", "no sharded runtime"),
    ("KV cache dtype", "`auto` (the target's dtype)", "no FP8/FP4 KV formats are validated"),
    ("prefill/decode disaggregation", "off", "not implemented; refused as in the release"),
    ("verification policy (`--verify-policy`)", "`fixed`, `cost`",
     "both are non-anticipating and pass the distribution test"),
]


class GuardError(ConfigError):
    """A setting the runtime has not validated. The message names the setting (the
    :class:`~dspine.config.SpeculativeConfig` field, :attr:`field`, where it is one), the
    value given and the accepted values."""


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    return str(dtype)


def check_device(device) -> None:
    """Refuse devices other than cpu/cuda, and cuda when CUDA is unavailable."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GuardError(f"SpeculativeConfig.device {device!r} is not validated; accepted: cpu, cuda",
                         field="device") from None
    if dev.type not in DEVICES:
        raise GuardError(f"SpeculativeConfig.device {device!r} is not validated; accepted: cpu, cuda", field="device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GuardError(f"SpeculativeConfig.device {device!r}: CUDA is not available on this machine; "
                         f"accepted here: cpu", field="device")


def resolve_device(name: str = "auto") -> torch.device:
    """The device for ``--device NAME`` (train, generate, serve, acceptance).

    ``auto`` is ``cuda:LOCAL_RANK`` (0 outside torchrun) when CUDA is available, else
    ``cpu``; ``cuda`` under torchrun also means ``cuda:LOCAL_RANK``.

    Raises:
        ConfigError: an unknown device, or ``cuda`` when no CUDA device is visible (naming
            ``SpeculativeConfig.device``).
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"SpeculativeConfig.device {name!r} is unknown; accepted: auto, cpu, cuda, cuda:N",
                          field="device") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"SpeculativeConfig.device {name!r} is not supported; accepted: auto, cpu, cuda, cuda:N",
                          field="device")
    if dev.type == "cpu" and dev.index not in (None, 0):  # torch accepts cpu:N and runs on the same CPU
        raise ConfigError(f"SpeculativeConfig.device {name!r}: there is one CPU device (use 'cpu'; threads are set "
                          f"with --threads)", field="device")
    if dev.type == "cpu":
        return torch.device("cpu")  # cpu:0 is the CPU
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"SpeculativeConfig.device {name}: CUDA is not available on this machine; "
                              f"use SpeculativeConfig.device='cpu'", field="device")
        idx = local if dev.index is None else dev.index
        if idx >= torch.cuda.device_count():
            raise ConfigError(f"SpeculativeConfig.device {name}: only {torch.cuda.device_count()} CUDA device(s) "
                              f"visible", field="device")
        dev = torch.device("cuda", idx)
    return dev


def check_dtype(dtype, what: str = "drafter") -> None:
    """Refuse a drafter (or target) dtype outside float32/bfloat16."""
    name = _dtype_name(dtype)
    accepted = DRAFTER_DTYPES if what == "drafter" else TARGET_DTYPES
    if name not in accepted:
        raise GuardError(f"SpeculativeConfig.dtype {name}: {what} dtype {name} is not validated; accepted: "
                         f"{', '.join(accepted)}", field="dtype")


def check_concurrency(concurrency: int) -> None:
    """Refuse concurrency outside 1..MAX_CONCURRENCY."""
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise GuardError(f"concurrency {concurrency!r} is not validated; accepted: 1..{MAX_CONCURRENCY} "
                         f"concurrent requests")


def check_block_size(block_size: int | None, drafter_cfg) -> None:
    """Refuse a block size different from the drafter checkpoint's."""
    if block_size is None or drafter_cfg is None:
        return
    if block_size != drafter_cfg.block_size:
        raise GuardError(f"SpeculativeConfig.block_size {block_size} differs from the drafter's block size "
                         f"{drafter_cfg.block_size}; accepted: {drafter_cfg.block_size} (a drafter runs only "
                         f"at its trained block size)", field="block_size")


def check_recurrent_state_dtype(dtype) -> None:
    """Refuse a recurrent (linear-attention) state dtype other than float32 (spec s.6, s.8)."""
    if dtype is None:
        return
    name = _dtype_name(dtype)
    if name not in STATE_DTYPES:
        raise GuardError(f"recurrent state dtype {name} is not validated; accepted: float32 "
                         f"(ReplaySSM keeps the linear-attention state in float32)")


def head_problem(head) -> str | None:
    """Why a target output head (module or weight) is not validated, or None when it is."""
    w = getattr(head, "weight", head)
    mod = head if isinstance(head, torch.nn.Module) else None
    if mod is not None and type(mod) is not torch.nn.Linear:
        return f"is a {type(mod).__name__} (quantized or wrapped), not a plain Linear"
    if not isinstance(w, torch.Tensor):
        return f"weight is a {type(w).__name__}, not a tensor"
    if type(w) not in (torch.Tensor, torch.nn.Parameter) or hasattr(w, "quant_state"):
        return f"weight is a {type(w).__name__} (quantized tensor subclass)"
    name = _dtype_name(w.dtype)
    if name not in TARGET_DTYPES:
        return f"weight dtype is {name} (quantized or unvalidated)"
    if not w.is_contiguous():
        return "weight is not contiguous"
    return None


def check_target_head(target, final_stage: bool = True) -> None:
    """Refuse a quantized / non-float / non-contiguous target output head."""
    model = getattr(target, "model", None)
    head = model.get_output_embeddings() if model is not None else target.output_head()
    why = head_problem(head)
    qcfg = getattr(getattr(model, "config", None), "quantization_config", None)
    if why is None and qcfg is not None and not _head_skipped(qcfg):
        why = "belongs to a quantized model (quantization_config present)"
    if why is not None:
        use = ("the final stage (candidates, conditional score tables)" if final_stage
               else "the drafter's continuous logits")
        raise GuardError(f"target output head {why}: {use} shares the target head and is validated only "
                         f"with an unquantized contiguous float32/bfloat16 head")


def _head_skipped(qcfg) -> bool:
    """True when a quantization config leaves ``lm_head`` unquantized."""
    d = qcfg if isinstance(qcfg, dict) else getattr(qcfg, "to_dict", lambda: vars(qcfg))()
    for key in ("llm_int8_skip_modules", "modules_to_not_convert", "skip_modules", "ignore"):
        v = d.get(key) or []
        if any("lm_head" in str(m) for m in v):
            return True
    return False


def validate_runtime(target=None, drafter_cfg=None, *, dtype="float32", device="cpu", concurrency: int = 1,
                     block_size: int | None = None, state_dtype=None, tensor_parallel: int = 1,
                     pipeline_parallel: int = 1, kv_cache_dtype: str = "auto",
                     disaggregated: bool = False, verify_policy: str | None = None) -> None:
    """Refuse any configuration the runtime has not validated (spec section 8).

    Args:
        target: a loaded :class:`dspine.target.adapter.Target`, or None to check the settings
            only (before loading). Its dtype, output head and (for hybrid targets) the
            ``recurrent_state_dtype`` attribute are checked.
        drafter_cfg: the drafter's :class:`DSpineConfig` or None (``ar`` mode).
        dtype: drafter weights/activations dtype (name or torch dtype).
        device, concurrency, block_size, state_dtype, tensor_parallel,
        pipeline_parallel, kv_cache_dtype, disaggregated, verify_policy: the settings.
    Raises:
        GuardError: naming the first refused setting and the accepted values.
    """
    check_device(device)
    if drafter_cfg is not None or target is None:
        check_dtype(dtype, "drafter")
    check_concurrency(concurrency)
    if tensor_parallel != 1:
        raise GuardError(f"tensor parallel size {tensor_parallel} is not validated; accepted: 1")
    if pipeline_parallel != 1:
        raise GuardError(f"pipeline parallel size {pipeline_parallel} is not validated; accepted: 1")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise GuardError(f"KV cache dtype {kv_cache_dtype!r} is not validated; accepted: auto "
                         f"(the target's dtype; no FP8/FP4 KV formats)")
    if disaggregated:
        raise GuardError("prefill/decode disaggregation is not validated; accepted: off")
    if verify_policy is not None:
        from dspine.config import VERIFY_POLICIES as POLICIES

        if verify_policy not in POLICIES:
            raise GuardError(f"SpeculativeConfig.verify_policy {verify_policy!r} is unknown; accepted: "
                             f"{', '.join(POLICIES)}", field="verify_policy")
    check_block_size(block_size, drafter_cfg)
    check_recurrent_state_dtype(state_dtype)
    if target is not None:
        check_dtype(target.dtype, "target")
        tdev = torch.device(getattr(target, "device", device))
        if tdev.type != torch.device(device).type:
            raise GuardError(f"SpeculativeConfig.device {device}: target is on {tdev}; drafter and target must "
                             f"share the device", field="device")
        check_recurrent_state_dtype(getattr(target, "recurrent_state_dtype", None))
        cfgs = [getattr(getattr(target, "model", None), "config", None), getattr(target, "config", None)]
        for cfg in [c for c in cfgs if c is not None]:
            for f in STATE_DTYPE_FIELDS:
                v = getattr(cfg, f, None)
                if v is not None and _dtype_name(v) not in STATE_DTYPES + ("fp32",):
                    raise GuardError(f"target config {f}={_dtype_name(v)}: recurrent state dtype "
                                     f"{_dtype_name(v)} is not validated; accepted: float32")
        if drafter_cfg is not None:
            check_target_head(target, final_stage=bool(drafter_cfg.final_stage))
