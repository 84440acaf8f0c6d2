"""Forged chunks (valid checksums, bytes not what nvCOMP wrote) of ANS and Bitcomp files, one per
file: what the isolated child makes of each, and whether a fresh process decoding it directly
(trusted) faults. Needs a GPU. JSON to $OUT/forged-debug.json (bench/results/2026-11-23-h100-integrity/)."""
import copy, json, os, random, subprocess, sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
import torch, gdsckpt
from gdsckpt.reading import isolated
from ckpt_tools import rebuild, set_chunk, split
from test_gpu_reader_corruption import _state, CHUNK
out = {}
d = Path(tempfile.mkdtemp())
state = _state("cuda")
for codec in ("ans", "bitcomp"):
    p = d / f"{codec}.gdsckpt"
    gdsckpt.save(state, p, codec=codec, chunk_bytes=CHUNK)
    data = p.read_bytes(); _, doc, _ = split(data)
    i = next(i for i, c in enumerate(doc["chunks"]) if not c.get("raw"))
    rec = doc["chunks"][i]
    orig = data[rec["file_offset"]:rec["file_offset"] + rec["stored"]]
    rng = random.Random(3)
    variants = {"random": rng.randbytes(rec["stored"]), "zeros": bytes(rec["stored"]),
                "shuffled-halves": orig[len(orig)//2:] + orig[:len(orig)//2], "truncated": orig[:len(orig)//2]}
    for name, stored in variants.items():
        dd = copy.deepcopy(doc)
        area, dd = set_chunk(data, dd, i, stored)
        q = d / f"{codec}-{name}.gdsckpt"
        q.write_bytes(rebuild(data, dd, data_area=area))
        r = {}
        try:
            with gdsckpt.open(q) as ck:
                r["child"] = {"vet_done": isolated.run(isolated.IndexedFile(ck.source, ck.index), [i], "gpu", 0)}
        except Exception as e:
            r["child"] = f"{type(e).__name__}: {e}"[:400]
        if not isinstance(r["child"], dict):
            out[f"{codec}-{name}"] = r
            print(codec, name, json.dumps(r)[:900], flush=True)
            continue
        pr = subprocess.run([sys.executable, "-c", f"import gdsckpt, torch; gdsckpt.load({str(q)!r}); torch.cuda.synchronize(); print('direct-decode-ok')"],
                            capture_output=True, text=True, timeout=90)
        r["parent_direct_after_child_ok"] = (pr.returncode, (pr.stdout + pr.stderr)[-400:])
        out[f"{codec}-{name}"] = r
        print(codec, name, json.dumps(r)[:900], flush=True)
Path(os.environ.get("OUT", "/tmp"), "forged-debug.json").write_text(json.dumps(out, indent=1))
