"""
train.py -- EDITED BY THE LOOP. The single file autoloop's proposers change: model, optimizer, training loop.

A small modern GPT (RMSNorm pre-norm, RoPE, QK-norm, ReLU^2 MLP, value embeddings, logit soft-capping) trained
with Muon (matrices) + AdamW (the rest) for a fixed wall-clock budget, then scored by prepare.py's
evaluate_bpb. Runs on CUDA, MPS or CPU. The run ends with the `---` summary block the controller parses.

Usage: python train.py   (budget, seed, data and harness profile come from prepare.py / the environment)
"""

import contextlib
import gc
import math
import os
import re
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

if __name__ == "__main__" and "PYTORCH_ALLOC_CONF" not in os.environ:
    # CUDA's caching allocator grows segments in place instead of fragmenting; read once torch starts (a user's
    # own setting wins).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
if __name__ == "__main__" and sys.platform.startswith("linux") and "GLIBC_TUNABLES" not in os.environ:
    # Keep freed tensor memory in the heap: otherwise every large activation is a fresh mmap that page-faults
    # (measured ~1.4x slower steps on a 2-core CPU). Re-exec so the allocator sees the setting at start-up.
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295"
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

import torch
import torch.nn as nn
import torch.nn.functional as F

from prepare import MAX_SEQ_LEN, PROFILE, SEED, TIME_BUDGET, Tokenizer, evaluate_bpb, make_dataloader


def per_profile(**values):
    """The value for the harness profile in use (prepare.PROFILE: gpu | cpu | tiny)."""
    return values[PROFILE]


# ---------------------------------------------------------------------------
# Hyperparameters (edit these directly; a trailing "# [lo, hi]", "# {a, b}" or "# [fixed]" guides the search)
# ---------------------------------------------------------------------------

# Model size
DEPTH = per_profile(gpu=8, cpu=4, tiny=2)  # transformer layers  [gpu: 2, 24; cpu: 1, 8; tiny: 1, 4]
ASPECT_RATIO = per_profile(gpu=64, cpu=32, tiny=64)  # model width = DEPTH * ASPECT_RATIO, rounded up to HEAD_DIM  [gpu: 32, 128; cpu: 16, 64; tiny: 16, 96]
HEAD_DIM = per_profile(gpu=128, cpu=64, tiny=32)  # channels per attention head  {32, 64, 128}
WINDOW_PATTERN = "auto"  # per-layer attention window, S=half L=full; auto: SSSL with FA3, else L  {auto, L, SL, SSL, SSSL}

# Batch
# Any pair is valid: the accumulation is derived (rounded), and a step never holds fewer sequences than one batch
DEVICE_BATCH_SIZE = per_profile(gpu=128, cpu=16, tiny=8)  # sequences per forward/backward (speed, memory)  [gpu: 16, 256; cpu: 2, 64; tiny: 1, 32]
TOTAL_BATCH_SIZE = per_profile(gpu=2**19, cpu=2**12, tiny=2**9)  # tokens per optimizer step, about  [gpu: 2**16, 2**21; cpu: 2**10, 2**15; tiny: 2**7, 2**12]

# Optimization
MATRIX_LR = 0.04  # Muon learning rate for the transformer's matrices  [0.002, 0.2]
EMBEDDING_LR = 0.6  # AdamW learning rate for token and value embeddings  [0.01, 3.0]
UNEMBEDDING_LR = 0.004  # AdamW learning rate for the output head  [0.0002, 0.05]
SCALAR_LR = 0.5  # AdamW learning rate for the per-layer residual scalars  [0.01, 2.0]
WEIGHT_DECAY = 0.2  # decoupled weight decay on Muon matrices  [0.0, 1.0]
ADAM_BETAS = (0.8, 0.95)  # AdamW (beta1, beta2)
MUON_MOMENTUM = 0.95  # final Muon momentum (warms up from 0.85 over the first 300 steps)  [0.8, 0.99]
WARMUP_RATIO = 0.0  # share of the budget spent warming the LR up  [0.0, 0.2]
WARMDOWN_RATIO = 0.5  # share of the budget spent decaying the LR  [0.0, 0.9]
FINAL_LR_FRAC = 0.0  # LR at the end as a share of the peak  [0.0, 0.5]
LOGIT_CAP = 15.0  # soft cap on the output logits  [5.0, 50.0]

# Evaluation
FINAL_EVAL_BATCH_SIZE = per_profile(gpu=256, cpu=32, tiny=16)  # sequences per eval forward (speed only)  [fixed]

# ---------------------------------------------------------------------------
# Device, precision, attention kernel
# ---------------------------------------------------------------------------


def pick_device():
    name = os.environ.get("AUTOLOOP_DEVICE")
    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cpu_bf16_is_fast():
    """Do bf16 matmuls beat fp32 on this CPU by a useful margin? Probed only where the CPU has bf16 units."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        flags = set()
    if not flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        return False  # emulated bf16 is many times slower than fp32
    a, b = torch.randn(256, 512), torch.randn(512, 1024)

    def bench(dtype):
        x, y = a.to(dtype), b.to(dtype)
        x @ y
        t0 = time.perf_counter()
        for _ in range(8):
            x @ y
        return time.perf_counter() - t0

    return bench(torch.bfloat16) < 0.8 * bench(torch.float32)


def pick_dtype(device):
    forced = os.environ.get("AUTOLOOP_DTYPE")
    if forced:
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[forced]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_bf16_is_fast() else torch.float32
    return torch.float32


FA3 = None  # the FlashAttention-3 interface once loaded (a module global: the model itself stays picklable)


def load_flash_attention_3(device, dtype):
    """The locally installed FlashAttention-3 (flash-attention's "hopper" build) for bf16 runs on a Hopper GPU,
    else None. Never downloaded: a run must not depend on the network."""
    if device.type != "cuda" or torch.version.hip or torch.cuda.get_device_capability(device) != (9, 0) \
            or dtype != torch.bfloat16:
        return None
    try:
        import flash_attn_interface

        return flash_attn_interface
    except Exception:  # not installed, or built against another torch/CUDA
        return None


def fast_sdpa(device):
    """On CUDA, SDPA tries its fastest kernels first: cuDNN, flash, memory-efficient, then math. No-op elsewhere
    and on torch without sdpa_kernel(..., set_priority=) (< 2.6)."""
    try:
        from torch.nn.attention import SDPBackend as B
        from torch.nn.attention import sdpa_kernel

        if device.type == "cuda":
            return sdpa_kernel([B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH], set_priority=True)
    except (ImportError, AttributeError, TypeError):
        pass
    return contextlib.nullcontext()


# Dense (non-sparse) datasheet peak FLOP/s: (full device name regex, bf16, tf32, fp32); None where the device has
# no such unit (tf32 then means fp32). Names must match in full: "RTX A1000" is no A100, "H200 NVL" no H200 SXM,
# and MIG slices, laptop parts and unlisted devices get a measured peak instead.
PEAK_FLOPS = [
    (r"NVIDIA H[128]00( \d+GB HBM3e?)?|NVIDIA GH200( \d+GB?( HBM3e?)?)?", 989e12, 494.7e12, 66.9e12),  # SXM
    (r"NVIDIA H[18]00 PCIe", 756e12, 378e12, 51.2e12),
    (r"NVIDIA H[12]00 NVL", 835e12, 417.5e12, 60e12),
    (r"NVIDIA A[18]00(-SXM4-|-PCIE-| )(40|80)GB( PCIe)?", 312e12, 156e12, 19.5e12),
    (r"NVIDIA B200", 2.25e15, 1.125e15, 75e12),
    (r"NVIDIA GB200", 2.5e15, 1.25e15, 80e12),
    (r"NVIDIA L40S", 362e12, 183e12, 91.6e12),
    (r"NVIDIA L40", 181e12, 90.5e12, 90.5e12),
    (r"NVIDIA L4", 121e12, 60e12, 30.3e12),
    (r"NVIDIA A10G", 70e12, 35e12, 31.2e12),
    (r"NVIDIA A10", 125e12, 62.5e12, 31.2e12),
    (r"NVIDIA RTX 6000 Ada Generation", 364.2e12, 182.1e12, 91.1e12),
    (r"NVIDIA RTX A6000", 154.8e12, 77.4e12, 38.7e12),
    (r"NVIDIA RTX A5000", 111.1e12, 55.6e12, 27.8e12),
    (r"NVIDIA GeForce RTX 5090", 209.5e12, 104.8e12, 104.8e12),
    (r"NVIDIA GeForce RTX 4090", 165.2e12, 82.6e12, 82.6e12),
    (r"NVIDIA GeForce RTX 3090", 71e12, 35.6e12, 35.6e12),
    (r"Tesla V100-SXM2-(16|32)GB", None, None, 15.7e12),
    (r"Tesla V100-PCIE-(16|32)GB", None, None, 14e12),
    (r"(Tesla|NVIDIA) T4", None, None, 8.1e12),
    (r"AMD Instinct MI300X( VF)?", 1307.4e12, 653.7e12, 163.4e12),
    (r"AMD Instinct MI250X", 191.5e12, None, 47.9e12),  # per die: torch sees each of its two GCDs as a device
]


def table_peak_flops(name, precision):
    """The datasheet peak FLOP/s of the device called `name` for precision bf16 | tf32 | fp32, or None."""
    for pattern, bf16, tf32, fp32 in PEAK_FLOPS:
        if re.fullmatch(pattern, name):
            return {"bf16": bf16, "tf32": tf32 or fp32, "fp32": fp32}[precision]
    return None


def measure_peak_flops(device, dtype):
    """Best-of-6 square matmul FLOP/s in the run's dtype (~0.1 s on a 2-core CPU): the peak of an unlisted device."""
    n = 1024 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(6):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device, dtype):
    """(peak FLOP/s for this run's matmuls, "table" | "measured"). fp32 on CUDA runs as TF32 where allowed."""
    if device.type == "cuda":
        tf32 = torch.backends.cuda.matmul.allow_tf32
        precision = "bf16" if dtype == torch.bfloat16 else "tf32" if tf32 else "fp32"
        flops = table_peak_flops(torch.cuda.get_device_name(device), precision)
        if flops:
            return flops, "table"
    return measure_peak_flops(device, dtype), "measured"


def peak_memory_mb(device):
    """Peak allocated GPU memory on CUDA; otherwise the process's peak resident memory (memory_kind: rss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "vram"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "rss"


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


@dataclass
class GPTConfig:
    sequence_len: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    window_pattern: str


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def has_value_embedding(layer, n_layer):
    return layer % 2 == (n_layer - 1) % 2  # alternate layers, always including the last


def apply_rotary(x, cos, sin):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.ve_gate_channels = 32
        self.ve_gate = (nn.Linear(self.ve_gate_channels, self.n_kv_head, bias=False)
                        if has_value_embedding(layer, config.n_layer) else None)

    def forward(self, x, ve, cos_sin, window, mask):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate_channels]))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))
        if FA3 is not None:  # bf16 autocast runs only: FA3 takes bf16, and q, k are fp32 after the norm
            y = FA3.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, window_size=(window - 1, 0))
            y = y[0] if isinstance(y, tuple) else y  # bf16, as autocast's c_proj takes it
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            gqa = self.n_kv_head != self.n_head
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            y = y.transpose(1, 2)
        return self.c_proj(y.contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer)
        self.mlp = MLP(config)

    def forward(self, x, ve, cos_sin, window, mask):
        x = x + self.attn(norm(x), ve, cos_sin, window, mask)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.windows = self.window_sizes(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
        self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        kv_dim = config.n_kv_head * (config.n_embd // config.n_head)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, kv_dim)
                                           for i in range(config.n_layer) if has_value_embedding(i, config.n_layer)})
        head_dim = config.n_embd // config.n_head
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(config.sequence_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        self._masks = {}

    @staticmethod
    def window_sizes(config):
        full = config.sequence_len
        sizes = [{"L": full, "S": full // 2}[config.window_pattern[i % len(config.window_pattern)]]
                 for i in range(config.n_layer)]
        sizes[-1] = full  # the last layer always sees the whole context
        return sizes

    @torch.no_grad()
    def init_weights(self):
        s = 3**0.5 * self.config.n_embd**-0.5  # uniform bound with std 1/sqrt(width)
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(lin.weight, -s, s)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.zeros_(block.attn.ve_gate.weight)
        for emb in self.value_embeds.values():
            nn.init.uniform_(emb.weight, -s, s)
        self.resid_lambdas.fill_(1.0)
        self.x0_lambdas.fill_(0.1)

    def mask(self, T, window, device):
        """None for plain causal attention; an exact sliding-window boolean mask otherwise (cached)."""
        if FA3 is not None or window >= T:
            return None
        key = (T, window, device)
        if key not in self._masks:
            i = torch.arange(T, device=device)
            self._masks[key] = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
        return self._masks[key]

    def estimate_flops_per_token(self):
        """Matmul FLOPs per token for forward+backward: 6 x (non-embedding params) + attention."""
        embedding = self.wte.weight.numel() + sum(e.weight.numel() for e in self.value_embeds.values())
        dense = sum(p.numel() for p in self.parameters()) - embedding
        head_dim = self.config.n_embd // self.config.n_head
        attention = sum(12 * self.config.n_head * head_dim * min(w, self.config.sequence_len) for w in self.windows)
        return 6 * dense + attention

    def forward(self, idx, targets=None, reduction="mean"):
        T = idx.size(1)
        cos_sin = (self.cos[:, :T], self.sin[:, :T])
        x = x0 = norm(self.wte(idx))
        for i, block in enumerate(self.blocks):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            window = self.windows[i]
            x = block(x, ve, cos_sin, window, self.mask(T, window, idx.device))
        logits = self.lm_head(norm(x)).float()
        logits = LOGIT_CAP * torch.tanh(logits / LOGIT_CAP)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1,
                               reduction=reduction)


# ---------------------------------------------------------------------------
# Optimizer: Muon for the transformer's matrices, AdamW for everything else
# ---------------------------------------------------------------------------


def orthogonalize(g, steps=5):
    """Newton-Schulz quintic iteration towards the nearest semi-orthogonal matrices (batched over dim 0)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    for _ in range(steps):
        m = x @ x.mT
        x = a * x + (b * m + c * m @ m) @ x
    return x.mT if transposed else x


class Muon(torch.optim.Optimizer):
    """Momentum, then orthogonalized updates in the compute dtype; same-shape matrices are stacked and done
    in one batched iteration, since many small matmuls cost more in dispatch than in arithmetic."""

    def __init__(self, params, lr, momentum, weight_decay, dtype):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.dtype = dtype

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(tuple(p.shape), []).append(p)
            for shape, params in by_shape.items():
                grads = torch.stack([p.grad for p in params])
                buf = self.state[params[0]].setdefault("momentum", torch.zeros_like(grads))
                buf.lerp_(grads, 1 - group["momentum"])
                g = grads.lerp_(buf, group["momentum"])  # Nesterov
                update = orthogonalize(g.to(self.dtype)).to(grads.dtype)
                scale = max(1.0, shape[0] / shape[1]) ** 0.5
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
                torch._foreach_add_(params, list(update.unbind(0)), alpha=-group["lr"] * scale)


def make_optimizers(model, dtype):
    width_scale = (model.config.n_embd / 768) ** -0.5  # AdamW LRs were tuned at width 768
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    groups = [
        dict(params=[model.wte.weight, *[e.weight for e in model.value_embeds.values()]], lr=EMBEDDING_LR * width_scale),
        dict(params=[model.lm_head.weight], lr=UNEMBEDDING_LR * width_scale),
        dict(params=[model.resid_lambdas], lr=SCALAR_LR * 0.01),
        dict(params=[model.x0_lambdas], lr=SCALAR_LR, betas=(0.96, 0.95)),
    ]
    adamw = torch.optim.AdamW(groups, betas=ADAM_BETAS, eps=1e-10, weight_decay=0.0, foreach=True)
    muon = Muon(matrices, lr=MATRIX_LR, momentum=MUON_MOMENTUM, weight_decay=WEIGHT_DECAY, dtype=dtype)
    for opt in (adamw, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return [adamw, muon]


# The LR schedule runs over a number of steps, projected from the throughput measured in the first CALIBRATION of
# the budget (that many steps fill the budget): with a schedule that followed the clock, every run saw slightly
# different learning rates, and runs of one configuration drifted apart. A run slowed later stops at OVERRUN.
CALIBRATION = 0.1
OVERRUN = 1.02
# A progress line at (the last step at or before) each 1/CURVE_POINTS of the planned steps, besides one a second:
# the controller keeps the loss at fixed fractions of the schedule in the run's record, for short runs too.
CURVE_POINTS = 20


def lr_multiplier(progress):
    if progress < WARMUP_RATIO:
        return progress / WARMUP_RATIO
    if progress < 1.0 - WARMDOWN_RATIO:
        return 1.0
    cooldown = (1.0 - progress) / WARMDOWN_RATIO
    return cooldown + (1 - cooldown) * FINAL_LR_FRAC


def last_step_before_point(steps_done, planned):
    """Is the step that completes `steps_done` of the `planned` steps the last one at or before a multiple of
    1/CURVE_POINTS of them? (in integers: no rounding decides it)"""
    point = -(-CURVE_POINTS * steps_done // planned)  # the first multiple at or after steps_done/planned
    return point * planned < CURVE_POINTS * (steps_done + 1)


def muon_momentum(step):
    frac = min(step / 300, 1)
    return (1 - frac) * 0.85 + frac * MUON_MOMENTUM


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def main():
    t_start = time.time()
    torch.manual_seed(SEED)
    device = pick_device()
    dtype = pick_dtype(device)
    autocast = torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)
    global FA3
    FA3 = fa3 = load_flash_attention_3(device, dtype)
    compile_model = os.environ.get("AUTOLOOP_COMPILE", "1" if device.type == "cuda" else "0") == "1"
    startup_steps = 10 if compile_model else 1  # steps not counted against the budget (compilation, warm-up)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokenizer = Tokenizer.from_directory()
    device_batch = max(1, min(DEVICE_BATCH_SIZE, TOTAL_BATCH_SIZE // MAX_SEQ_LEN))
    grad_accum = max(1, round(TOTAL_BATCH_SIZE / (device_batch * MAX_SEQ_LEN)))
    tokens_per_step = grad_accum * device_batch * MAX_SEQ_LEN  # TOTAL_BATCH_SIZE, rounded to whole micro-batches
    train_loader = make_dataloader(tokenizer, device_batch, MAX_SEQ_LEN, "train", device=device)
    first_batch = ThreadPoolExecutor(1).submit(next, train_loader)  # packed while the model is built
    model_dim = math.ceil(DEPTH * ASPECT_RATIO / HEAD_DIM) * HEAD_DIM
    pattern = WINDOW_PATTERN if WINDOW_PATTERN != "auto" else ("SSSL" if fa3 is not None else "L")
    config = GPTConfig(sequence_len=MAX_SEQ_LEN, vocab_size=tokenizer.get_vocab_size(), n_layer=DEPTH,
                       n_head=model_dim // HEAD_DIM, n_kv_head=model_dim // HEAD_DIM, n_embd=model_dim,
                       window_pattern=pattern)
    model = GPT(config).to(device)
    model.init_weights()
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = model.estimate_flops_per_token()
    optimizers = make_optimizers(model, dtype)
    step_model = torch.compile(model, dynamic=False) if compile_model else model

    x, y, epoch = first_batch.result()
    peak, peak_source = peak_flops(device, dtype)
    print(f"device: {device} | dtype: {str(dtype).removeprefix('torch.')} | attention: {'fa3' if fa3 else 'sdpa'} "
          f"| compile: {compile_model} | profile: {PROFILE} | peak: {peak / 1e12:.2f} TFLOP/s ({peak_source})")
    print(f"params: {num_params / 1e6:.2f}M | width {model_dim} | depth {DEPTH} | batch {device_batch} x {grad_accum} "
          f"| budget {TIME_BUDGET:g}s | startup {time.time() - t_start:.1f}s", flush=True)

    smooth_loss, training_time, step, last_print = 0.0, 0.0, 0, 0.0
    step_times, planned_steps = [], None  # the schedule's length in steps, once projected from the throughput
    while True:
        synchronize(device)
        t0 = time.time()
        for _ in range(grad_accum):
            try:
                with autocast:
                    loss = step_model(x, y)
                (loss / grad_accum).backward()
            except Exception as e:  # torch.compile compiles in the first steps: its failure must not end the run
                if step_model is model or step >= startup_steps:
                    raise
                error = f"{type(e).__name__}: {next(iter(str(e).strip().splitlines()), '')}"[:200]
                print(f"note: torch.compile failed ({error}); continuing in eager mode", flush=True)
                step_model, loss = model, None
                model.zero_grad(set_to_none=True)
                with autocast:  # this micro-batch again, eager; later steps of the warm-up stay uncounted
                    loss = step_model(x, y)
                (loss / grad_accum).backward()
            x, y, epoch = next(train_loader)
        if planned_steps is None:  # the first CALIBRATION of the budget (the LR is still flat unless warming up)
            progress = min(training_time / TIME_BUDGET, 1.0)
        else:  # a function of the step alone: runs of one configuration follow one trajectory
            progress = min((step - startup_steps) / planned_steps, 1.0)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr_multiplier(progress)
        optimizers[1].param_groups[0]["momentum"] = muon_momentum(step)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if not math.isfinite(loss_value) or loss_value > 100:
            print(f"FAIL: training loss exploded ({loss_value}) at step {step}", flush=True)
            sys.exit(1)
        synchronize(device)
        dt = time.time() - t0
        if step >= startup_steps:
            training_time += dt
            step_times.append(dt)
        if step == 0:
            gc.collect()
            gc.freeze()  # the Python GC otherwise stalls steps scanning long-lived objects
            gc.disable()
        smooth_loss = 0.9 * smooth_loss + 0.1 * loss_value
        debiased = smooth_loss / (1 - 0.9 ** (step + 1))
        step += 1
        if planned_steps is None and training_time >= CALIBRATION * TIME_BUDGET and len(step_times) >= 4:
            per_step = statistics.median(step_times[len(step_times) // 4:])  # past the first steps' warm-up
            planned_steps = len(step_times) + max(0, int((TIME_BUDGET - training_time) / per_step))
            print(f"schedule: {planned_steps} steps ({per_step * 1000:.0f}ms per step over the first "
                  f"{len(step_times)})", flush=True)
        finished = step - startup_steps >= planned_steps if planned_steps else training_time >= TIME_BUDGET
        stop = step > startup_steps and (finished or training_time >= OVERRUN * TIME_BUDGET)
        # the share of the schedule done with this step: of the planned steps, or until they are known, of the budget
        if planned_steps:
            share_done = min((step - startup_steps) / planned_steps, 1.0)
            at_point = last_step_before_point(step - startup_steps, planned_steps)
        else:
            share_done, at_point = min(training_time / TIME_BUDGET, 1.0), False
        if time.time() - last_print >= 1.0 or finished or stop or at_point:
            last_print = time.time()
            tok_per_s = tokens_per_step / dt
            mfu = 100 * flops_per_token * tok_per_s / peak
            print(f"step {step:05d} ({100 * share_done:.1f}%) | loss: {debiased:.6f} | dt: {dt * 1000:.0f}ms "
                  f"| tok/sec: {tok_per_s:,.0f} | mfu: {mfu:.1f}% | epoch: {epoch} "
                  f"| remaining: {max(0.0, TIME_BUDGET - training_time):.0f}s", flush=True)
        if stop:
            break

    memory_mb, memory_kind = peak_memory_mb(device)  # the training peak, before evaluation adds its own
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.eval()
    FA3 = None  # the evaluated graph uses scaled_dot_product_attention: FA3 is a custom kernel the harness refuses
    with autocast:  # evaluate_bpb returns nan under the controller, which evaluates the exported model itself
        val_bpb = evaluate_bpb(model, tokenizer, FINAL_EVAL_BATCH_SIZE)
    eval_memory_mb, _ = peak_memory_mb(device)  # on CPU the process's overall peak (rss never goes down)
    counted_steps = max(step - startup_steps, 1)
    total_tokens = step * tokens_per_step
    mfu = 100 * flops_per_token * tokens_per_step * counted_steps / training_time / peak
    print("---")
    print(f"val_bpb:          {val_bpb:.6f}")
    print(f"training_seconds: {training_time:.1f}")
    print(f"total_seconds:    {time.time() - t_start:.1f}")
    print(f"peak_vram_mb:     {memory_mb:.1f}")
    print(f"mfu_percent:      {mfu:.2f}")
    print(f"total_tokens_M:   {total_tokens / 1e6:.1f}")
    print(f"num_steps:        {step}")
    print(f"num_params_M:     {num_params / 1e6:.1f}")
    print(f"depth:            {DEPTH}")
    print(f"device:           {device.type}")
    print(f"memory_kind:      {memory_kind}")
    print(f"dtype:            {str(dtype).removeprefix('torch.')}")
    print(f"profile:          {PROFILE}")
    print(f"peak_tflops:      {peak / 1e12:.2f}")
    print(f"peak_source:      {peak_source}")
    print(f"planned_steps:    {planned_steps or 0}")
    if not math.isnan(val_bpb):
        print(f"eval_vram_mb:     {eval_memory_mb:.1f}")


if __name__ == "__main__":
    with fast_sdpa(pick_device()):
        main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything is written: skip the interpreter's teardown of torch (~0.2 s of every run)
