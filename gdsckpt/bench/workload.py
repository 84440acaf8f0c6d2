"""The benchmark's default data: a real training state, made deterministically.

A GPT-2-shaped decoder is trained with AdamW under bf16 autocast (fp32 on the CPU) on the bytes of Python's own
standard library sources (text that ships with every Python), then returned as a training
checkpoint would hold it: bf16 model weights, fp32 master weights, AdamW's exp_avg,
exp_avg_sq and step. The base state is cached (safetensors + JSON, never pickle) after the
first run; larger sizes replicate it with small deterministic perturbations, never zeros.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {  # name: (layers, d_model, heads, vocab, context, train seq, batch, steps)
    "gpt2-small": (12, 768, 12, 50257, 1024, 128, 8, 300),
    "tiny": (4, 256, 4, 256, 256, 64, 8, 30),  # byte vocabulary: quick on two CPU cores
}


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn_qkv, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn_proj(a)
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, vocab: int, context: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.h = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _corpus(limit: int = 8 << 20) -> torch.Tensor:
    root = Path(os.__file__).parent
    data = bytearray()
    for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        data += p.read_bytes()
        if len(data) >= limit:
            break
    return torch.frombuffer(bytearray(data[:limit]), dtype=torch.uint8).long()


def _train(name: str, device: str, steps: int | None) -> dict:
    layers, d, heads, vocab, context, seq, batch, default_steps = SHAPES[name]
    steps = default_steps if steps is None else steps
    torch.manual_seed(0)
    model = GPT(layers, d, heads, vocab, context).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    text = _corpus().to(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    dev_type = "cuda" if device.startswith("cuda") else "cpu"
    for _ in range(steps):
        starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=g)
        idx = torch.stack([text[s:s + seq + 1] for s in starts.tolist()])
        # bf16 autocast on the GPU, as training runs; CPUs without bf16 units emulate it ~20x
        # slower, so the CPU stand-in computes in fp32 (its weights are still stored as bf16).
        with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=dev_type == "cuda"):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"model": {k: v.to(torch.bfloat16) for k, v in master.items()}, "master": master,
            "optimizer": opt.state_dict()}


def _flat(state: dict) -> tuple[dict, dict]:
    """Tensors under "/"-joined keys, and the optimizer's param_groups (JSON)."""
    tensors = {f"model/{k}": v for k, v in state["model"].items()}
    tensors.update({f"master/{k}": v for k, v in state["master"].items()})
    for pid, st in state["optimizer"]["state"].items():
        tensors.update({f"optimizer/{pid}/{k}": v for k, v in st.items()})
    return tensors, {"param_groups": state["optimizer"]["param_groups"]}


def _unflat(tensors: dict, extra: dict) -> dict:
    state = {"model": {}, "master": {}, "optimizer": {"state": {}, "param_groups": extra["param_groups"]}}
    for key, t in tensors.items():
        top, rest = key.split("/", 1)
        if top == "optimizer":
            pid, name = rest.split("/")
            state["optimizer"]["state"].setdefault(int(pid), {})[name] = t
        else:
            state[top][rest] = t
    for g in state["optimizer"]["param_groups"]:
        g["betas"] = tuple(g["betas"])
    return state


def base_state(name: str, device: str, cache_dir: str | None = None, steps: int | None = None) -> dict:
    from safetensors.torch import load_file, save_file
    cache = Path(cache_dir or os.environ.get("GDSCKPT_CACHE", Path.home() / ".cache" / "gdsckpt"))
    stem = cache / f"{name}-steps{steps or SHAPES[name][-1]}-torch{torch.__version__.split('+')[0]}"
    if stem.with_suffix(".safetensors").exists() and stem.with_suffix(".json").exists():
        tensors = load_file(stem.with_suffix(".safetensors"), device=device)
        return _unflat({k: tensors[k] for k in json.loads(stem.with_suffix(".json").read_text())["order"]},
                       json.loads(stem.with_suffix(".json").read_text()))
    train_dev = device if device.startswith("cuda") else "cpu"
    state = _train(name, train_dev, steps)
    tensors, extra = _flat(state)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = stem.with_suffix(".safetensors.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    os.replace(tmp, stem.with_suffix(".safetensors"))
    stem.with_suffix(".json").write_text(json.dumps({**extra, "order": list(tensors)}))
    return _unflat({k: v.to(device) for k, v in tensors.items()}, extra)


def nbytes(state) -> int:
    from gdsckpt.tree import flatten
    return sum(leaf.tensor.nbytes for leaf in flatten(state)[1])


def make_state(size: str = "auto", device: str | None = None, cache_dir: str | None = None,
               steps: int | None = None) -> dict:
    """The realistic state. size: "auto" (gpt2-small on CUDA, tiny on the CPU), "tiny",
    "gpt2-small", or a byte size like "4GB": that many bytes of replicas of the gpt2-small state
    (the base one first, then copies under "replica{i}" whose fp32 tensors are nudged by a
    deterministic relative 1e-3 noise and whose bf16 weights are re-cast from those)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if size == "auto":
        size = "gpt2-small" if device.startswith("cuda") else "tiny"
    if size in SHAPES:
        return base_state(size, device, cache_dir, steps)
    from .cli import parse_size
    target = parse_size(size)
    base = base_state("gpt2-small" if device.startswith("cuda") else "tiny", device, cache_dir, steps)
    state, total, i = {"replica0": base}, nbytes(base), 1
    g = torch.Generator(device=device).manual_seed(7)
    while total < target:
        rep = {"master": {}, "model": {}, "optimizer": {"state": {}, "param_groups": base["optimizer"]["param_groups"]}}
        for k, v in base["master"].items():
            rep["master"][k] = v * (1 + 1e-3 * torch.randn(v.shape, device=device, generator=g))
            rep["model"][k] = rep["master"][k].to(torch.bfloat16)
        for pid, st in base["optimizer"]["state"].items():
            rep["optimizer"]["state"][pid] = {
                k: (v * (1 + 1e-3 * torch.randn(v.shape, device=device, generator=g)) if v.dim() else v.clone())
                for k, v in st.items()}
        state[f"replica{i}"] = rep
        total += nbytes(rep)
        i += 1
    return state


def random_state(nbytes_: int, device: str) -> dict:
    """Random normal tensors (half bf16, half fp32) of transformer-like shapes: labelled random."""
    g = torch.Generator(device=device).manual_seed(0)
    state, total, i = {}, 0, 0
    while total < nbytes_:
        state[f"w{i}"] = torch.randn(4096, 1024, device=device, generator=g).to(
            torch.bfloat16 if i % 2 else torch.float32)
        total += state[f"w{i}"].nbytes
        i += 1
    return state


def zeros_state(nbytes_: int, device: str) -> dict:
    n = max(1, nbytes_ // (4096 * 1024 * 4))
    return {f"w{i}": torch.zeros(4096, 1024, device=device) for i in range(n)}


def file_state(path: str, device: str) -> dict:
    """A user's own .safetensors or .pt file (torch.load with weights_only: no arbitrary pickles)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path, device=device)
    return torch.load(path, map_location=device, weights_only=True)
