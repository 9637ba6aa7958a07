import sys, time, os, statistics, numpy as np, statestream as ss
p = sys.argv[1]
if sys.argv[2] == "make":
    rng = np.random.default_rng(0)
    ss.save(p, {f"w{i}": rng.standard_normal(16 << 20).astype(np.float32) for i in range(16)}, hashes=True, overwrite=True)
    ss.save(p + "-z", {f"w{i}": (rng.integers(0, 16, 16 << 20)).astype(np.float32) for i in range(4)}, hashes=True, compression="zstd", overwrite=True)
    sys.exit()
for path in (p, p + "-z"):
    ts = []
    for _ in range(4):
        t = time.perf_counter(); r = ss.verify(path); ts.append(time.perf_counter() - t); assert r.ok
    print(sys.argv[2], os.path.basename(path), "verify median %.3f s (%s)" % (statistics.median(ts[1:]), " ".join("%.3f" % x for x in ts)))
