import sys, torch
sys.argv = [sys.argv[0]]
sys.path.insert(0, "scripts")
import gpu_check as gc
for model, B in (("tiny-llama", 4), ("tiny-llama", 1)):
    rig = gc.Rig(model, B, max_seq=256, splits=2)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, rig.cfg.vocab_size, (B,), generator=g)
    pos = torch.zeros(B, dtype=torch.int64)
    for s in range(4):
        lr, nr = rig.ref_step(tok, pos); lm, nm = rig.mk_step(tok, pos); tok, pos = nr, pos + 1
    for k in range(1, 9):
        lr, nr = rig.ref_step(tok, pos, nsteps=k)
        lm, nm = rig.mk_step(tok, pos, nsteps=k)
        rel = ((lm - lr).norm() / lr.norm()).item()
        print(model, B, "k", k, "ref", nr.tolist(), "mk", nm.tolist(), f"rel {rel:.3e}", "margins", gc.tie_margins_ulps(lr, nr, nm), flush=True)
    # teacher-forced single steps for the same 8 positions
    t2, p2 = tok.clone(), pos.clone()
    for k in range(8):
        lr, nr = rig.ref_step(t2, p2); lm, nm = rig.mk_step(t2, p2)
        print(model, B, "tf", k, "ref", nr.tolist(), "mk", nm.tolist(), f"rel {((lm-lr).norm()/lr.norm()).item():.3e}", flush=True)
        t2, p2 = nr, p2 + 1
