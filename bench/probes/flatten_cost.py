"""What tree.flatten costs on the training's own host (issue 22: the overlapped call's largest part).

    PYTHONPATH=<wheels>:. python3 bench/probes/flatten_cost.py     # on the GPU host; prints

The bench's GPT (gpt2-medium, 1,172 tensors with AdamW's state) on the GPU after 3 steps, the
collector off: flatten of the bench's checkpoint state (min and median ms of 50), the state_dict
calls, and attribute reads over the tensors alone (_check_tensor's; numel, get_device, data_ptr;
is_contiguous, itemsize); then 10 times a training step, state_dict and flatten (ms each).
"""
import time, sys, statistics, gc, timeit
sys.path.insert(0, "bench/probes"); sys.path.insert(0, ".")
import torch
from gdsckpt.bench.train_methods import checkpoint_state
from gdsckpt.format.tree import flatten, _check_tensor
from idle_trace import step, warm_loop
model, opt, batches, info = warm_loop("gpt2-medium", 3)
st = checkpoint_state(model, opt)
sk, leaves = flatten(st)
ts = [l.tensor for l in leaves]
def m(f, n=50):
    return round(min(timeit.repeat(f, number=1, repeat=n))*1e3, 3), round(statistics.median(timeit.repeat(f, number=1, repeat=n))*1e3, 3)
gc.disable()
print("flatten warm", m(lambda: flatten(st)))
print("state_dict", m(lambda: checkpoint_state(model, opt)))
print("check", m(lambda: [_check_tensor(t, "k") for t in ts]))
print("numel+dev+ptr", m(lambda: [(t.numel(), t.get_device(), t.data_ptr()) for t in ts]))
print("contig+itemsize", m(lambda: [(t.is_contiguous(), t.itemsize) for t in ts]))
print("loop only", m(lambda: [t for t in ts]))
cold = []
for i in range(10):
    step(model, opt, batches)
    a = time.perf_counter(); s2 = checkpoint_state(model, opt); b = time.perf_counter(); flatten(s2); c = time.perf_counter()
    cold.append((round((b-a)*1e3, 2), round((c-b)*1e3, 2)))
print("after a step: state_dict, flatten", cold)
print(sys.version)
