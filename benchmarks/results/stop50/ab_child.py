import time, shutil, os, sys, tempfile, statistics, json
import torch, statestream as ss
torch.manual_seed(0)
n = int(sys.argv[1]); mode = sys.argv[3]
state = {f"p{i}": torch.randn(256) for i in range(n)}
d = tempfile.mkdtemp()
res = []
for i in range(int(sys.argv[2])):
    p = os.path.join(d, f"c{i%2}"); shutil.rmtree(p, ignore_errors=True)
    time.sleep(0.3)
    t = time.perf_counter()
    if mode == "sync": ss.save(p, state); res.append(time.perf_counter() - t)
    else:
        h = ss.save_async(p, state, lazy=mode == "lazy"); res.append(time.perf_counter() - t); h.result()
shutil.rmtree(d)
print(mode, "%.4f" % statistics.median(res[1:]), "first %.4f" % res[0])
