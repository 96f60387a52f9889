"""Model FLOPs utilisation (MFU): what share of a GPU's arithmetic a training step used.

MFU is the model's FLOPs per second over the peak FLOPs per second of the hardware (the PaLM
paper's definition, Chowdhery et al. 2022, appendix B). *Model* FLOPs are those of one forward
and one backward pass, counted once: a step that recomputes its forward under activation
checkpointing does more arithmetic than it is credited with (that larger count is the
*hardware* FLOPs utilisation). The peak is the GPU's dense bf16 tensor-core rate, from the
vendor's datasheet: most of NVIDIA's datasheets print only the rate with 2:4 structured
sparsity, marked so, and the dense rate, the one a training step's dense matrices can use, is
half of it. The steps the book times on GPUs run bf16 autocast, except chapter 2's FP32 and
TF32 rungs, whose MFU is against the same peak: what share of the GPU's best they reach.

- :func:`wrn_step_flops` counts a Wide-ResNet's step with ``FlopCounterMode`` on the meta
  device (shapes alone: no memory, no arithmetic, any machine);
- :func:`gpt_step_flops`: the GPT's, 6 FLOPs per parameter and token plus the attention
  scores (:func:`tutorial_utils.models.gpt.flops_per_token`); :func:`causal_attention_flops`:
  causal attention's alone (chapter 8's context parallelism);
- :data:`PEAKS` maps the names ``torch.cuda.get_device_name`` reports to each peak, and
  :func:`mfu` divides. A GPU not in the table, or rows measured on CPU processes, have no MFU
  (None; the tables print "-").
"""

from __future__ import annotations

import functools
import math
import textwrap
from dataclasses import dataclass

from .report import Column


@dataclass(frozen=True)
class Peak:
    """One GPU's dense bf16 tensor-core peak, as its datasheet gives it."""

    gpu: str  # the book's short name
    names: tuple[str, ...]  # what torch.cuda.get_device_name reports for it
    tflops: float  # dense bf16 tensor-core peak, TFLOP/s
    cite: str  # its source, a key of book/references.bib
    printed: str  # what the source prints, from which the dense rate is read

    @property
    def flops(self) -> float:
        """The peak in FLOP/s."""
        return self.tflops * 1e12


_SPARSE = "with sparsity; dense is half"
PEAKS: tuple[Peak, ...] = (
    Peak("H100 SXM", ("NVIDIA H100 80GB HBM3",), 989.5, "nvidia_h100",
         f"BFLOAT16 Tensor Core 1,979 TFLOPS {_SPARSE}"),
    Peak("H100 NVL", ("NVIDIA H100 NVL",), 835.5, "nvidia_h100",
         f"BFLOAT16 Tensor Core 1,671 TFLOPS {_SPARSE}"),
    Peak("H100 PCIe", ("NVIDIA H100 PCIe",), 756.5, "nvidia_h100",
         f"BFLOAT16 Tensor Core 1,513 TFLOPS {_SPARSE}"),
    Peak("H200 SXM", ("NVIDIA H200",), 989.5, "nvidia_h200",
         f"BFLOAT16 Tensor Core 1,979 TFLOPS {_SPARSE}"),
    Peak("H200 NVL", ("NVIDIA H200 NVL",), 835.5, "nvidia_h200",
         f"BFLOAT16 Tensor Core 1,671 TFLOPS {_SPARSE}"),
    Peak("A100 SXM4 40GB", ("NVIDIA A100-SXM4-40GB",), 312, "nvidia_a100",
         "BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    Peak("A100 SXM4 80GB", ("NVIDIA A100-SXM4-80GB",), 312, "nvidia_a100",
         "BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    Peak("A100 PCIe 40GB", ("NVIDIA A100-PCIE-40GB",), 312, "nvidia_a100",
         "BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    Peak("A100 PCIe 80GB", ("NVIDIA A100 80GB PCIe",), 312, "nvidia_a100",
         "BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    Peak("L4", ("NVIDIA L4",), 121, "nvidia_l4", f"BF16 Tensor Core 242 TFLOPS {_SPARSE}"),
    Peak("L40S", ("NVIDIA L40S",), 362.05, "nvidia_l40s",
         "BFLOAT16 Tensor Core 362.05 TFLOPS (733 with sparsity)"),
    Peak("GeForce RTX 4090", ("NVIDIA GeForce RTX 4090",), 165.2, "nvidia_ada",
         "peak BF16 Tensor with FP32 accumulate 165.2 TFLOPS (330.4 with sparsity)"),
)


def _key(name: str) -> str:
    """A GPU name compared without case, repeated spaces or the vendor's prefix."""
    return " ".join(name.casefold().split()).removeprefix("nvidia ")


_BY_NAME = {_key(n): p for p in PEAKS for n in p.names}


def peak_of(gpu: str | None) -> Peak | None:
    """The peak of the GPU named ``gpu`` (as ``torch.cuda.get_device_name`` reports it), or
    None for a GPU the table does not know, or no GPU."""
    return _BY_NAME.get(_key(gpu)) if gpu else None


def gpu_of(where) -> str | None:
    """The GPU that measured: the first of the ``gpu_names`` of an environment stamp (a dict, an
    :class:`~tutorial_utils.stamp.EnvironmentStamp`, or a record's ``Source`` holding one).
    None where no GPU measured: a CPU-only stamp, or rows from CPU processes, which carry none."""
    stamp = getattr(where, "stamp", where)  # a Source holds its stamp; a stamp is one
    if stamp is None:
        return None
    names = stamp.get("gpu_names") if isinstance(stamp, dict) else stamp.gpu_names
    return names[0] if names else None


def this_gpu() -> str | None:
    """The name of this machine's first GPU, or None on a machine without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def of_rate(flops_per_s: float | None, gpu: str | None, gpus: int = 1) -> float | None:
    """MFU of ``flops_per_s`` model FLOPs per second done by ``gpus`` GPUs named ``gpu``
    together: the rate per GPU over one GPU's dense bf16 peak. None where unknown."""
    peak = peak_of(gpu)
    if peak is None or flops_per_s is None or not math.isfinite(flops_per_s):
        return None
    return flops_per_s / gpus / peak.flops


def mfu(flops_per_step: float, step_ms: float | None, gpu: str | None,
        gpus: int = 1) -> float | None:
    """MFU of a step of ``flops_per_step`` model FLOPs (all ``gpus`` GPUs together) that took
    ``step_ms`` milliseconds. None for an unknown GPU, no GPU, or no step time."""
    if not step_ms or not math.isfinite(step_ms):
        return None
    return of_rate(flops_per_step / (step_ms / 1e3), gpu, gpus)


@functools.lru_cache(maxsize=64)
def wrn_step_flops(model: str, batch: int) -> float:
    """Model FLOPs of one training step (forward and backward) of the Wide-ResNet ``model`` on
    ``batch`` 32x32 images: counted on the meta device, from the shapes alone, on any machine.
    Matrix products and convolutions count 2 FLOPs per multiply-add; element-wise work and the
    optimizer's update are not counted (they are a small part, and cost memory traffic rather
    than tensor-core arithmetic)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from ..models.wrn import wide_resnet

    with torch.device("meta"):
        net = wide_resnet(model)
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(net(x), y).backward()
    return float(counter.get_total_flops())


def wrn_images(images_per_s: float | None, model: str, gpu: str | None,
               gpus: int = 1) -> float | None:
    """MFU of ``gpus`` GPUs named ``gpu`` training ``images_per_s`` images per second of the
    Wide-ResNet ``model`` together. None where unknown."""
    if images_per_s is None:
        return None
    return of_rate(images_per_s * wrn_step_flops(model, 1), gpu, gpus)


@functools.lru_cache(maxsize=16)
def _gpt_params(cfg) -> int:
    """The parameters one token uses: all of a dense GPT's; with experts, each block's router
    and ``top_k`` of its ``experts`` identical expert MLPs (what ``flops_per_token`` asks)."""
    import torch

    from ..models.gpt import GPT

    with torch.device("meta"):
        named = GPT(cfg).named_parameters()
        share = cfg.top_k / cfg.experts if cfg.experts else 1.0
        return round(sum(p.numel() * (share if ".experts." in n else 1) for n, p in named))


def gpt_step_flops(cfg, batch: int, n_params: int | None = None) -> float:
    """Model FLOPs of one training step of the GPT of ``cfg`` (a ``GPTConfig``) on ``batch``
    sequences of ``cfg.seq`` tokens: 6 per parameter and token plus the attention scores
    (``flops_per_token``, the PaLM paper's count). ``n_params``: counted on the meta device if
    not given (with experts, only those a token uses). Recomputation under activation
    checkpointing is not counted: model FLOPs."""
    from ..models.gpt import flops_per_token

    n = _gpt_params(cfg) if n_params is None else n_params
    return flops_per_token(cfg, n) * batch * cfg.seq


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Model FLOPs of causal attention's forward and backward on ``batch`` sequences of ``seq``
    tokens: the scores ``Q K^T`` and their weighted sum of ``V``, 2 FLOPs per multiply-add over
    the half of the ``seq`` x ``seq`` pairs the mask keeps, ``2 * batch * heads * seq**2 *
    head_dim`` in forward, and twice that in backward (four products). A fused kernel that
    recomputes the scores in backward does more; that is not counted."""
    return 6.0 * batch * heads * seq**2 * head_dim


def percent(share: float | None) -> float:
    """An MFU in per cent for the prose, NaN where there is none."""
    return 100 * share if share is not None else math.nan


def short_name(gpu: str | None) -> str:
    """The book's short name of the GPU named ``gpu`` ("H100 SXM"), else its own name."""
    peak = peak_of(gpu)
    return peak.gpu if peak else gpu or "no GPU"


COLUMN = Column("mfu", "MFU", ".1%", 7)  # the tables' column, "-" where there is no MFU


def against(gpu: str | None, label: str = "MFU") -> str:
    """What the tables' MFU column (``label``) divides by, in words, for a note under a table."""
    peak = peak_of(gpu)
    if gpu is None:
        return f"{label}: none, the rows were not measured on a GPU"
    if peak is None:
        return f"{label}: none, this book has no datasheet peak for the {gpu}"
    return (f"{label}: model FLOPs per second and GPU over the {gpu}'s dense bf16 peak, "
            f"{peak.tflops:g} TFLOP/s")


def note(gpu: str | None, flops: str, label: str = "MFU") -> str:
    """The lines under a table (96 characters at most): what its MFU column (``label``)
    divides by, and how many model FLOPs a step does (``flops``, in words)."""
    return textwrap.fill(f"{against(gpu, label)}; {flops}.", 96, subsequent_indent="  ")


def gflop(flops: float) -> str:
    """FLOPs in GFLOP to three significant digits at least: "4,027 GFLOP", "31.5 GFLOP"."""
    g = flops / 1e9
    digits = max(0, 2 - math.floor(math.log10(g))) if g > 0 else 0
    return f"{g:,.{digits}f} GFLOP"


def wrn_flops_text(model: str, batches) -> str:
    """A Wide-ResNet's model FLOPs per image and per step of each of ``batches`` images (per
    GPU), in words, for the note under a table."""
    steps = ", ".join(f"{gflop(wrn_step_flops(model, b))} at {b}" for b in sorted(set(batches)))
    return (f"{model.upper()}: {gflop(wrn_step_flops(model, 1))} per image, forward + backward"
            + (f"; per GPU and step {steps} images" if steps else ""))


SOURCES = {"nvidia_h100": "NVIDIA's H100 datasheet", "nvidia_h200": "NVIDIA's H200 datasheet",
           "nvidia_a100": "NVIDIA's A100 datasheet", "nvidia_l4": "NVIDIA's L4 datasheet",
           "nvidia_l40s": "NVIDIA's L40S datasheet",
           "nvidia_ada": "NVIDIA's Ada architecture whitepaper"}  # each peak's cite, in words


def peaks_table(gpus_used: dict[str, list[str]] | None = None) -> str:
    """A Markdown table of every peak: the GPU, the name it reports, the dense bf16 rate, its
    source and what that prints; and, from ``gpus_used`` (a GPU name -> the records measured
    on it), the records each GPU made."""
    used = {_key(k): v for k, v in (gpus_used or {}).items()}
    lines = ["| GPU | reported as | dense bf16 TFLOP/s | source: what it prints | records |",
             "|---|---|---|---|---|"]
    for p in PEAKS:
        made = sorted({r for n in p.names for r in used.get(_key(n), [])})
        lines.append(f"| {p.gpu} | {', '.join(f'`{n}`' for n in p.names)} | {p.tflops:g} | "
                     f"{SOURCES[p.cite]}: {p.printed} | "
                     f"{', '.join(f'`{r}`' for r in made) or '-'} |")
    return "\n".join(lines)
