"""Where nvCOMP's native bitstream keeps a chunk's compressed size: encode chunks of several kinds
with the ring's codecs and print nvCOMP's buffer_sizes beside the first 128 bytes of each output
(as little-endian uint32 and uint64 words), to find the header field that equals it.

    python bench/probes/nvcomp_header.py
"""

import json

import cupy
import numpy as np
import torch

from gdsckpt import codecs
from gdsckpt.engine.gpu.codecs import NvcompCodecs

stream = cupy.cuda.Stream(non_blocking=True)
c = NvcompCodecs(stream, 0)
g = torch.Generator(device="cuda").manual_seed(0)
n = 64 << 20
datas = {
    "fp32_adam": (torch.randn(n // 4, device="cuda", generator=g) * 1e-3).view(torch.uint8),
    "bf16": (torch.randn(n // 2, device="cuda", generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8),
    "random_bytes": torch.randint(0, 256, (n,), device="cuda", dtype=torch.uint8, generator=g),
    "zeros": torch.zeros(n, dtype=torch.uint8, device="cuda"),
    "odd_len": (torch.randn(n // 4, device="cuda", generator=g)).view(torch.uint8)[:n - 4 * 1001],
}
out = []
for dname, t in datas.items():
    for cname, dtype in (("ans", "float32"), ("ans-planes", "float32"), ("ans", "bfloat16"), ("bitcomp", "float32")):
        spec = codecs.spec_for(cname, dtype, "6.0.0", side="gpu")
        src = cupy.asarray(t)
        buf = cupy.empty(c.max_stored(spec, src.nbytes), dtype=cupy.uint8)
        scratch = cupy.empty(src.nbytes, dtype=cupy.uint8)
        stored, _ = c.encode(spec, src.copy(), buf, scratch)
        head = cupy.asnumpy(buf[:128])
        out.append({"data": dname, "codec": cname, "dtype": dtype, "n": int(src.nbytes), "stored": int(stored),
                    "u32": head.view(np.uint32).tolist(), "u64": head.view(np.uint64).tolist()})
        print(dname, cname, dtype, src.nbytes, stored, head.view(np.uint32)[:24].tolist(), flush=True)
json.dump(out, open("nvcomp_header.json", "w"), indent=0)
