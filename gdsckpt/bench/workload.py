"""The benchmark's data: a real training state, made deterministically.

A GPT-2-shaped decoder is trained with AdamW under bf16 autocast on Python's own standard
library sources (text that ships with every Python; see token_windows), then returned the way a
mixed-precision training checkpoint holds it: bf16 model weights, fp32 master weights and real
AdamW state (fp32 exp_avg, exp_avg_sq, step). Compression ratios measured on random or zero
tensors say nothing about checkpoints; these bytes have the exponent and mantissa statistics of
trained weights and optimizer moments.

The trained base state is cached (safetensors + JSON, never pickle), so only the first run
trains. Nothing in gdsckpt decides these bytes: the state is only walked (counted, moved to
its device) through gdsckpt.format.tree.flatten, by states.py.
"""

from __future__ import annotations

import json
import math
import os
import platform
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gdsckpt.core.units import format_bytes, parse_size  # parse_size: also cost.py's, through here
from .states import nbytes, to_device

# name: layers, heads, d_model, vocab, context, train seq, batch, default steps, peak lr
SIZES = {
    # GPT-2 small's tensor shapes (vocab 50257, context 1024; untied head: 163M parameters),
    # trained on full 1024-token sequences so that every position embedding is trained.
    "gpt2-small": (12, 12, 768, 50257, 1024, 1024, 4, 300, 6e-4),
    # ~1.9M parameters, ~26 MB of state: trains in about 10 s on one CPU core.
    "tiny": (4, 4, 192, 256, 128, 128, 4, 60, 2e-3),
}
TOKEN_BYTES = 4
_RECIPE = 3  # bump when training changes, so stale caches are not reused
_PERTURB = 1e-2  # relative noise on replicated layers: keeps value statistics, defeats LZ matches


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class _MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), _Attention(d, heads), nn.LayerNorm(d), _MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-style GPT-2 (same parameter names and shapes as GPT-2, untied lm_head)."""

    def __init__(self, layers: int, heads: int, d: int, vocab: int, context: int):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(context, d),
            h=nn.ModuleList(_Block(d, heads) for _ in range(layers)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in tr.h:
            x = block(x)
        return self.lm_head(tr.ln_f(x))


def corpus() -> torch.Tensor:
    """The standard library's top-level .py files, sorted, as uint8 bytes (site-packages
    excluded: it differs between environments)."""
    root = Path(os.path.dirname(os.__file__))
    data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def token_windows(vocab: int, seq: int) -> torch.Tensor:
    """The corpus cut into non-overlapping (seq + 1)-token windows, one row each.

    A token is TOKEN_BYTES consecutive bytes, hashed (Knuth's multiplicative hash, high bits) to an
    id below `vocab`: ids then follow a Zipf-like law over the whole vocabulary, as BPE tokens do.
    Plain byte tokens would leave all but 256 of GPT-2's 50257 embedding rows without gradient,
    their AdamW moments exactly zero: 13% of the state compressing to nothing, a flattering lie.
    """
    text = corpus()
    span = TOKEN_BYTES * (seq + 1)
    pos = torch.arange(0, len(text) // span * span, TOKEN_BYTES).view(-1, seq + 1)
    code = sum(text[pos + i].long() << (8 * (TOKEN_BYTES - 1 - i)) for i in range(TOKEN_BYTES))
    return ((code * 2654435761) % (1 << 32) >> 8) % vocab


class Bf16Matmuls(torch.overrides.TorchFunctionMode):
    """bf16 autocast's numerics at fp32 speed, for CPUs without bf16 units (there, real CPU
    autocast runs bf16 GEMMs ~20x slower than fp32). As autocast does, linear layers and attention
    take bf16-rounded operands, accumulate in fp32 (as bf16 tensor cores and AMX do) and return
    bf16-rounded results; through autograd, gradients are rounded to bf16 at the same points."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in (F.linear, F.scaled_dot_product_attention):
            return func(*args, **(kwargs or {}))
        args = [a.to(torch.bfloat16).float() if isinstance(a, torch.Tensor) else a for a in args]
        return func(*args, **(kwargs or {})).to(torch.bfloat16).float()


def _train(name: str, device: str, steps: int) -> dict:
    layers, heads, d, vocab, context, seq, batch, _, lr = SIZES[name]
    dev_type = torch.device(device).type
    torch.manual_seed(0)
    with torch.device(device):  # initialising 163M parameters on a CPU takes seconds
        model = GPT(layers, heads, d, vocab, context)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    windows = token_windows(vocab, seq)
    g = torch.Generator().manual_seed(1)  # CPU generator: the same batches on every device
    order = torch.empty(0, dtype=torch.long)
    warmup = max(1, steps // 10)
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.get_num_threads())
    # GPU kernels (embedding backward, attention) may use atomics; ask for the deterministic ones.
    torch.use_deterministic_algorithms(True, warn_only=True)
    if dev_type == "cpu":
        # One thread: the same bytes on machines with any core count (GEMM splits differ), and
        # graceful on a busy machine, where two spinning OpenMP threads ran 5-10x slower here.
        torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(steps):
                for group in opt.param_groups:  # linear warm-up, then cosine decay to 10%
                    frac = max(0.0, (step - warmup) / max(1, steps - warmup))
                    group["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * frac))
                if len(order) < batch:  # epochs over the corpus in shuffled window order
                    order = torch.cat([order, torch.randperm(len(windows), generator=g)])
                idx, order = windows[order[:batch]].to(device), order[batch:]
                with torch.autocast(dev_type, dtype=torch.bfloat16) if dev_type == "cuda" else Bf16Matmuls():
                    logits = model(idx[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), idx[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.set_num_threads(prev[2])
    master = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"model": {k: v.to(torch.bfloat16) for k, v in master.items()},
            "optimizer": opt.state_dict(), "master": master}


# Cache: one safetensors file with "/"-joined keys, plus JSON for key order and param_groups.

def _flatten(state: dict) -> tuple[dict, dict]:
    tensors = {f"model/{k}": v for k, v in state["model"].items()}
    for pid, st in state["optimizer"]["state"].items():
        tensors.update({f"optimizer/state/{pid}/{k}": v for k, v in st.items()})
    tensors.update({f"master/{k}": v for k, v in state["master"].items()})
    return tensors, {"keys": list(tensors), "param_groups": state["optimizer"]["param_groups"]}


def _unflatten(tensors: dict, meta: dict) -> dict:
    groups = [{**g, "betas": tuple(g["betas"])} for g in meta["param_groups"]]
    state = {"model": {}, "optimizer": {"state": {}, "param_groups": groups}, "master": {}}
    for key in meta["keys"]:
        top, rest = key.split("/", 1)
        if top == "optimizer":
            _, pid, name = rest.split("/")
            state["optimizer"]["state"].setdefault(int(pid), {})[name] = tensors[key]
        else:
            state[top][rest] = tensors[key]
    return state


def _cache_paths(cache_dir: str | None, name: str, steps: int, dev_type: str) -> tuple[Path, Path] | None:
    where = cache_dir if cache_dir is not None else os.environ.get(
        "GDSCKPT_CACHE", str(Path.home() / ".cache" / "gdsckpt"))
    if where in ("", "off"):
        return None
    # Trained bytes depend on torch's kernels, Python's stdlib text and the device's arithmetic.
    tag = f"{name}_steps{steps}_torch{torch.__version__.split('+')[0]}_py{platform.python_version()}" \
          f"_{dev_type}_r{_RECIPE}"
    return Path(where) / f"{tag}.safetensors", Path(where) / f"{tag}.json"


def base_state(name: str, device: str, cache_dir: str | None = None, steps: int | None = None) -> dict:
    """The trained state of SIZES[name], on `device` (trained there if it is a GPU, else on the CPU)."""
    from safetensors.torch import load_file, save_file
    steps = SIZES[name][7] if steps is None else steps
    train_dev = device if torch.device(device).type == "cuda" else "cpu"
    paths = _cache_paths(cache_dir, name, steps, torch.device(train_dev).type)
    if paths and all(p.exists() for p in paths):
        return _steps_on_cpu(to_device(_unflatten(load_file(paths[0]), json.loads(paths[1].read_text())), device))
    state = _train(name, train_dev, steps)
    if paths:
        tensors, meta = _flatten(state)
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        for path, write in ((paths[0], lambda p: save_file(tensors, p)),  # tensors first: JSON marks done
                            (paths[1], lambda p: p.write_text(json.dumps(meta)))):
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # atomic: concurrent runs share the dir
            write(tmp)
            os.replace(tmp, path)
    return _steps_on_cpu(to_device(state, device))


def _steps_on_cpu(state: dict) -> dict:
    """torch.optim.AdamW keeps each parameter's `step` on the CPU unless it is capturable or
    fused, so a GPU training state mixes host scalars into its fp32 tensors: keep that mix."""
    for s in state["optimizer"]["state"].values():
        s["step"] = s["step"].cpu()
    return state


def make_state(size: str = "auto", device: str | None = None, cache_dir: str | None = None,
               steps: int | None = None) -> dict:
    """A realistic mixed-precision training state: {"model": {name: bf16}, "optimizer":
    AdamW.state_dict(), "master": {name: fp32}}, on `device` but for AdamW's `step` counters,
    which stay on the CPU as torch.optim.AdamW keeps them.

    size: "tiny" (4 layers, d_model 192, 256-token vocabulary; ~26 MB), "gpt2-small" (GPT-2 small's
    shapes with an untied head; ~2.28 GB), "auto" (gpt2-small on CUDA, tiny on the CPU), or a
    byte count such as "1GB" / "4GB" / "16GB": the auto base state with as many transformer
    blocks as fit in that many bytes, and the bytes left as a part of the next block (its first
    parameters, the last cut to whole rows), so that the state holds the bytes asked, short by
    less than one row of a tensor (at most 43 kB). Below the base state's size its first blocks
    are kept; above it, copies of its blocks are appended (block i copies block i % n_layer, each
    tensor scaled by 1 + 1e-2 * N(0,1) deterministic noise, bf16 weights re-cast from the
    perturbed fp32 master, AdamW state extended to match). A byte count below min_bytes(device)
    (the embeddings and head alone) is a ValueError.
    device: default "cuda" if available, else "cpu". Training runs on `device` if it is a GPU,
    else on the CPU (where bf16 autocast is emulated: see Bf16Matmuls). gpt2-small: 300 steps
    of 4 x 1024 tokens (about one epoch of the corpus); tiny: 60 steps of 4 x 128 tokens.
    cache_dir: default $GDSCKPT_CACHE or ~/.cache/gdsckpt; "off" disables the cache. The cache
    is keyed by size, steps, torch and Python versions and the training device's kind.
    steps: AdamW steps (default per size as above).
    Deterministic: fixed seeds, sorted corpus files, deterministic algorithms; on the CPU two
    builds are bit-identical, on a GPU the cache makes repeated runs identical.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    auto = "gpt2-small" if torch.device(device).type == "cuda" else "tiny"
    if size == "auto":
        size = auto
    if size in SIZES:
        return base_state(size, device, cache_dir, steps)
    target = parse_size(size)
    if target < min_bytes(device):
        raise ValueError(f"{size!r}: the realistic state on {torch.device(device).type} is at least "
                         f"{format_bytes(min_bytes(device))} (its embeddings and head)")
    state = base_state(auto, device, cache_dir, steps)
    names = list(state["master"])  # parameter order == optimizer param ids
    pid_of = {n: i for i, n in enumerate(names)}
    layers = SIZES[auto][0]
    block = [n.split(".", 3)[3] for n in names if n.startswith("transformer.h.0.")]
    head = [n for n in names if not n.startswith("transformer.h.")][:2]  # wte, wpe
    tail = [n for n in names if not n.startswith("transformer.h.")][2:]  # ln_f, lm_head

    def cost(n: str, rows: int | None = None) -> int:
        """Bytes parameter n stores (bf16 weight, fp32 master, AdamW moments and step), its
        first `rows` rows only if given."""
        t = state["master"][n]
        return (rows if rows is not None else t.shape[0]) * t[:1].numel() * 14 + 4
    fixed = sum(cost(n) for n in head + tail)
    per_block = sum(cost(f"transformer.h.0.{s}") for s in block)
    depth, left = divmod(target - fixed, per_block)
    # The rest as a part of block `depth`: its parameters in order, each whole while it fits, the
    # one that does not fit cut to the rows that do (a parameter of no row left out).
    partial: list[tuple[str, int | None]] = []
    for s in block:
        n = f"transformer.h.{depth}.{s}"
        src = f"transformer.h.{depth % layers}.{s}"
        whole = state["master"][src].shape[0]
        rows = min(whole, max(0, left - 4) // (cost(src, 1) - 4))
        if rows:
            partial.append((n, None if rows == whole else rows))
            left -= cost(src, rows)
    if depth == layers and not partial:
        return state
    sizes = dict(partial)
    new_names = head + [f"transformer.h.{i}.{s}" for i in range(depth) for s in block] + [n for n, _ in partial] + tail
    model, master, opt_state = {}, {}, {}
    old_state = state["optimizer"]["state"]
    for pid, n in enumerate(new_names):
        rows = sizes.get(n)
        cut = (lambda t: t[:rows].clone()) if rows is not None else (lambda t: t)
        i = int(n.split(".")[2]) if n.startswith("transformer.h.") else -1
        if i < layers:  # the trained tensors themselves
            model[n], master[n] = cut(state["model"][n]), cut(state["master"][n])
            opt_state[pid] = {k: (cut(v) if v.dim() else v) for k, v in old_state[pid_of[n]].items()}
            continue
        src_name = f"transformer.h.{i % layers}.{n.split('.', 3)[3]}"
        src = old_state[pid_of[src_name]]
        g = torch.Generator(device=device).manual_seed(10_000 * i + block.index(n.split(".", 3)[3]))

        def nudge(t):
            t = cut(t)
            return t * (1 + _PERTURB * torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype))
        master[n] = nudge(state["master"][src_name])
        model[n] = master[n].to(torch.bfloat16)
        opt_state[pid] = {k: (nudge(v) if v.dim() else v.clone()) for k, v in src.items()}
    groups = [{**pg, "params": list(range(len(new_names)))} for pg in state["optimizer"]["param_groups"]]
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": groups}, "master": master}


def min_bytes(device: str) -> int:
    """The smallest realistic state make_state builds on `device`'s kind (auto's model): its
    embeddings, final norm and head, with no transformer block (from the shapes, nothing built)."""
    auto = "gpt2-small" if torch.device(device).type == "cuda" else "tiny"
    _, _, d, vocab, context = SIZES[auto][:5]
    params = [vocab * d, context * d, d, d, vocab * d]  # wte, wpe, ln_f weight and bias, lm_head
    return sum(14 * n + 4 for n in params)


# GPT-2 small's parameter shapes of one block, cycled by the synthetic states.
_SHAPES = [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,), (768,), (768,), (3072, 768), (3072,),
           (768, 3072), (768,)]


def _synthetic(nbytes_: int, device: str, fill) -> dict:
    """Same layout and dtype mix as make_state (per parameter: bf16 weight, fp32 master, fp32
    exp_avg / exp_avg_sq, step), so that results compare with the realistic state's."""
    state = {"model": {}, "optimizer": {"state": {}, "param_groups": [{"params": []}]}, "master": {}}
    total, i = 0, 0
    while total < nbytes_:
        shape, name = _SHAPES[i % len(_SHAPES)], f"p{i}"
        # fewer rows near the target, so that the state overshoots it by less than one row
        row = math.prod(shape[1:])
        shape = (min(shape[0], -(-(nbytes_ - total) // (14 * row))), *shape[1:])
        state["model"][name] = fill(shape, 0.02).to(torch.bfloat16)
        state["master"][name] = fill(shape, 0.02)
        st = {"step": torch.tensor(300.0, device=device), "exp_avg": fill(shape, 1e-3),
              "exp_avg_sq": fill(shape, 1e-3).square()}
        state["optimizer"]["state"][i] = st
        state["optimizer"]["param_groups"][0]["params"].append(i)
        total += 14 * math.prod(shape) + 4
        i += 1
    return state


def random_state(nbytes_: int, device: str) -> dict:
    """Independent normal random values (seeded) in the training state's layout, at least nbytes_
    bytes. Full-entropy mantissas: a worst case for compression, not a realistic one."""
    g = torch.Generator(device=device).manual_seed(0)
    return _synthetic(nbytes_, device, lambda shape, std: std * torch.randn(shape, generator=g, device=device))


def zeros_state(nbytes_: int, device: str) -> dict:
    """All zeros in the training state's layout: compresses unrealistically well."""
    return _synthetic(nbytes_, device, lambda shape, std: torch.zeros(shape, device=device))


def file_state(path: str, device: str) -> dict:
    """A user's own .safetensors or .pt file (.pt via torch.load(weights_only=True): no arbitrary
    pickles are executed)."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file
        return to_device(load_file(path), device)
    return torch.load(path, map_location=device, weights_only=True)
