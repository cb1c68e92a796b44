"""Time per training iteration in fused mode (the default) on CPU: four
768 -> 3072 -> 768 MLP blocks, batch 256, 2 threads, forward + backward with
the updates inside backward. Run it twice to compare the library's jobs on
torch's OpenMP team (default) with its own pool:

    python bench/fused_training.py
    AUTOMAGIC_TORCH_THREADS=0 python bench/fused_training.py
"""
import os, time, torch, automagic
torch.set_num_threads(2)
torch.manual_seed(0)
layers = []
for _ in range(4):
    layers += [torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768)]
model = torch.nn.Sequential(*layers)
opt = automagic.Automagic3(model.parameters())  # fused (default)
x = torch.randn(256, 768)
def it():
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
for _ in range(3): it()
ts = []
for _ in range(int(os.environ.get("REPS", "15"))):
    t0 = time.perf_counter(); it(); ts.append(time.perf_counter() - t0)
ts.sort()
print("%s: min %.1f ms median %.1f ms" % (os.environ.get("AUTOMAGIC_TORCH_THREADS", "torch team"), ts[0]*1e3, ts[len(ts)//2]*1e3))
