"""Host profile of three durable 4 GB saves to fresh files: where the time outside the ring goes."""
import cProfile, pstats, io, os
from pathlib import Path
import gdsckpt
from gdsckpt.bench.sinks import NullSink
from gdsckpt.bench.workload import make_state
state = make_state("4GB", device="cuda")
gdsckpt.save(state, None, _sink=NullSink())
d = Path("/tmp/pd"); d.mkdir(exist_ok=True)
gdsckpt.save(state, d / "w.gdsckpt"); (d / "w.gdsckpt").unlink(); os.sync()
prof = cProfile.Profile()
for i in range(3):
    prof.enable(); s = gdsckpt.save(state, d / f"s{i}.gdsckpt"); prof.disable()
    print(round(s.seconds, 3), {k: round(v, 4) for k, v in s.stages.items()}, flush=True)
    (d / f"s{i}.gdsckpt").unlink(); os.sync()
buf = io.StringIO()
pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats(45)
print(buf.getvalue())
