"""The PyTorch side of `bench/vs_pytorch.py`: our GPT written in PyTorch, timed on the same step.

Run by `vs_pytorch.py`, in a throwaway environment that has torch (never the project's), and by
`gpu_stages.py` on the GPU image, whose Python has torch:

    uv run --no-project --with 'torch==2.13.*' --with numpy python bench/torch_gpt.py SPEC.json

SPEC names a `.npz` of our model's initial weights and batches, the config, and how many steps to
time; this prints one JSON line: parameter count, the loss of the first batch before any step,
and the step times. Optional SPEC fields, for nanoGPT's GPU recipe (`bench/gpu_check.py`):
`device` ("cuda"), `autocast` ("bfloat16": the forward under `torch.autocast`), `tf32` (TF32
matmuls, as nanoGPT allows), `fused` (fused AdamW) and `block` (steps dispatched back to back
between synchronisations; each step's time is its block's mean).

The model is eqx_gpt's architecture (scaled embedding + sinusoidal positions, pre-norm blocks with
bias-free RMSNorm, fused QKV, tanh-GELU MLP, no biases, padded vocabulary with the padding logits
sliced off) and the step is the trainer's: AdamW (weight decay on matrices and embeddings, not norm
scales), global-norm clipping, dropout where the config has it.
"""

import json
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, w: dict, i: int, n_heads: int, dropout: float, eps: float):
        super().__init__()
        p = lambda name: torch.nn.Parameter(torch.from_numpy(w[f"blocks.{name}"][i].copy()))
        self.attn_norm, self.w_qkv, self.w_attn_out = p("attn_norm"), p("w_qkv"), p("w_attn_out")
        self.mlp_norm, self.w_in, self.w_mlp_out = p("mlp_norm"), p("w_in"), p("w_mlp_out")
        self.n_heads, self.dropout, self.eps = n_heads, dropout, eps

    def rms(self, x, scale):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale

    def forward(self, x):
        b, t, d = x.shape
        h = self.rms(x, self.attn_norm) @ self.w_qkv
        q, k, v = (a.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for a in h.split(d, dim=2))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).reshape(b, t, d) @ self.w_attn_out
        x = x + F.dropout(y, p, self.training)
        y = F.gelu(self.rms(x, self.mlp_norm) @ self.w_in, approximate="tanh") @ self.w_mlp_out
        return x + F.dropout(y, p, self.training)


class GPT(torch.nn.Module):
    def __init__(self, w: dict, config: dict):
        super().__init__()
        c = self.config = config
        self.embed = torch.nn.Parameter(torch.from_numpy(w["embed"].copy()))
        self.head = torch.nn.Parameter(torch.from_numpy(w["head"].copy()))
        self.final_norm = torch.nn.Parameter(torch.from_numpy(w["final_norm"].copy()))
        self.blocks = torch.nn.ModuleList(
            Block(w, i, c["n_heads"], c["dropout"], c["norm_eps"]) for i in range(c["n_layers"])
        )
        self.register_buffer("positions", torch.from_numpy(w["positions"].copy()))

    def forward(self, idx, targets):
        c = self.config
        x = self.embed[idx] * math.sqrt(c["d_model"]) + self.positions[: idx.shape[1]]
        x = F.dropout(x, c["dropout"], self.training)
        for block in self.blocks:
            x = block(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["norm_eps"]) * self.final_norm
        logits = (x @ self.head)[..., : c["vocab_size"]]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    device = torch.device(spec.get("device", "cpu"))
    w = dict(np.load(spec["weights"]))
    model = GPT(w, spec["config"]).to(device)
    batches = torch.from_numpy(w["batches"].astype(np.int64)).to(device)
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    t = spec["train"]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=1e-8, fused=spec.get("fused", False),
    )  # fmt: skip
    model.eval()
    with torch.no_grad():  # in full float32 (TF32 is allowed only below), to compare with eqx_gpt's
        loss0 = float(model(batches[0][:, :-1], batches[0][:, 1:]))
    model.train()
    if spec.get("tf32"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    step = torch.compile(model) if spec["compile"] else model
    dtype = getattr(torch, spec["autocast"]) if spec.get("autocast") else None
    cast = lambda: torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    def one(i):
        batch = batches[i % len(batches)]
        with cast():
            loss = step(batch[:, :-1], batch[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        optimizer.step()
        return loss

    def sync(loss):
        float(loss)  # waits for the step's kernels, on any device

    for i in range(spec["warmup"]):
        sync(one(i))
    times, block = [], spec.get("block", 1)
    for first in range(0, spec["steps"], block):
        start = time.perf_counter()
        for i in range(first, first + block):
            loss = one(i)
        sync(loss)
        times += [(time.perf_counter() - start) / block] * block
    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"n_params": n_params, "loss0": loss0, "step_s": times, "torch": torch.__version__,
                      "device": str(device)}))  # fmt: skip


if __name__ == "__main__":
    main()
