"""Training speed: our trainer (hidden states once, each step only the head) against a loop
in the style of the paper's code (a full forward through the frozen model every step), on
the embedded model, with the same batches, side by side in one run (steps interleaved, so
both see the same machine load).

    .venv/bin/python benchmarks/train_speed.py                 # per-step ratio
    .venv/bin/python benchmarks/train_speed.py --full-run      # + a whole detox steer
    .venv/bin/python benchmarks/train_speed.py --options       # step cost per option only

``--options`` times one training step of our trainer under each option (head dtype, tokens
per step, threads) on the same batches, and the share of a step spent in the head GEMM over
the vocabulary, and prints the projected time of a 1,000-step run for each.

Prints a Markdown table (paste under "## Training" in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_steer.train.config import TrainConfig  # noqa: E402
from vllm_steer.train.data import load_dataset, preset_data_config  # noqa: E402
from vllm_steer.train.hidden import compute_hidden  # noqa: E402
from vllm_steer.train.module import LMSteer, load_model  # noqa: E402
from vllm_steer.train.trainer import BatchSchedule, pad_batch, prepare  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default=None, help="data folder (default $VLLM_STEER_DATA)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps of each loop")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--texts", type=int, default=200, help="training texts per side")
    ap.add_argument("--full-run", action="store_true",
                    help="also time a whole detox steer with steers/train_all.sh's recipe")
    ap.add_argument("--options", action="store_true",
                    help="only time one step under each option (head dtype, --step-tokens, "
                         "threads); prints projected 1,000-step times")
    args = ap.parse_args()
    if args.options:
        return options(args)

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cfg = TrainConfig(model=args.model, rank=args.rank, batch_size=args.batch_size,
                      max_length=args.max_length, steps=args.steps)
    data = preset_data_config("detox", args.data, max_examples=args.texts, dev_max_per_side=1)
    prep = prepare(cfg, load_dataset(data, cfg.seed), log)
    device = prep.device
    # the baseline runs the paper's default precision (float32 model, no autocast)
    base_model, tok, _ = load_model(args.model, device, torch.float32)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    t = time.perf_counter()
    cpu = time.process_time()
    hs = compute_hidden(prep.model, tok, prep.train_ids, prep.train_sides,
                        cache_dtype=prep.cache_dtype, batch_tokens=cfg.cache_batch_tokens,
                        progress=True)
    hidden_s, hidden_cpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = int(hs.lengths().sum())

    ours = LMSteer(prep.model, cfg.rank, cfg.domain_rank, cfg.epsilon, cfg.init_std, cfg.seed)
    ours_fp32 = LMSteer(prep.model, cfg.rank, cfg.domain_rank, cfg.epsilon, cfg.init_std,
                        cfg.seed)
    paper = LMSteer(base_model, cfg.rank, cfg.domain_rank, cfg.epsilon, cfg.init_std, cfg.seed)
    opts = {k: torch.optim.Adam(m.factor_params(), lr=cfg.lr)
            for k, m in (("ours", ours), ("ours_fp32", ours_fp32), ("paper", paper))}
    sched = BatchSchedule(hs.num_texts, cfg.batch_size, cfg.seed)
    times: dict[str, list[float]] = {k: [] for k in opts}
    real_tokens, padded_tokens = [], []

    def step_ours(lm, opt, idx, hd):
        c, tgt, s = hs.batch(idx, device)
        opt.zero_grad()
        lm.loss_backward(c, tgt, s, head_dtype=hd, chunk_tokens=cfg.chunk_tokens)
        opt.step()

    def step_paper(idx):
        # as the paper's train.py: tokenize the batch's texts, pad to the longest, full forward
        texts = [prep.dataset.train[i].text for i in idx]  # noqa: F841 (what it tokenizes)
        ids, att = pad_batch([prep.train_ids[i] for i in idx], pad, device)
        signs = torch.tensor([float(prep.train_sides[i]) for i in idx], device=device)
        opts["paper"].zero_grad()
        paper.full_loss(ids, att, signs).backward()
        opts["paper"].step()
        real_tokens.append(int(att.sum()))
        padded_tokens.append(att.numel())

    hd = prep.head_dtype
    for step in range(args.steps + 1):  # step 0 is a warm-up, not timed
        idx = sched.indices(step)
        for name, fn in (("paper", lambda idx=idx: step_paper(idx)),
                         ("ours", lambda idx=idx: step_ours(ours, opts["ours"], idx, hd)),
                         ("ours_fp32", lambda idx=idx: step_ours(ours_fp32, opts["ours_fp32"], idx,
                                                         torch.float32))):
            t = time.perf_counter()
            fn()
            if step > 0:
                times[name].append(time.perf_counter() - t)
        log(f"step {step}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items() if v))

    med = {k: statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n### Per step (detox, batch {cfg.batch_size}, max length {cfg.max_length}, "
          f"rank {cfg.rank} + domain {cfg.rank}, {args.steps} steps each, interleaved)\n")
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average "
          f"{load:.1f} at the end (shared machine: absolute times are pessimistic, the ratios "
          "are measured side by side).\n")
    print("| loop | median s/step | speed-up vs paper-style |")
    print("|---|---|---|")
    print(f"| paper-style: full forward of the frozen model (fp32) every step, padded batch "
          f"({statistics.mean(real_tokens):.0f} real of {statistics.mean(padded_tokens):.0f} "
          f"tokens) | {med['paper']:.2f} | 1.0x |")
    print(f"| ours, exact (cached states, fp32 head) | {med['ours_fp32']:.2f} | "
          f"{med['paper'] / med['ours_fp32']:.1f}x |")
    print(f"| ours, default (cached states, {str(hd).replace('torch.', '')} head) | "
          f"{med['ours']:.2f} | **{med['paper'] / med['ours']:.1f}x** |")
    print(f"\nOne-time hidden-state pass ({str(prep.model_dtype).replace('torch.', '')} model): "
          f"{tokens} tokens of {hs.num_texts} texts in {hidden_s:.1f}s ({tokens / hidden_s:.0f} "
          f"tokens/s; {hidden_cpu:.0f} CPU-s); it pays for itself after "
          f"{hidden_s / max(med['paper'] - med['ours'], 1e-9):.1f} steps.")

    if args.full_run:
        from vllm_steer.train.trainer import train_steer

        full_cfg = TrainConfig(model=args.model, rank=args.rank, steps=FULL["steps"],
                               batch_size=FULL["batch_size"], max_length=FULL["max_length"],
                               eval_every=0, checkpoint_every=0)
        full_data = preset_data_config("detox", args.data, max_examples=FULL["max_examples"],
                                       dev_max_per_side=FULL["dev_max"])
        t, cpu = time.perf_counter(), time.process_time()
        res = train_steer(full_cfg, full_data, None, progress=True)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        w = res.metrics["wall_s"]
        print(f"\nWhole detox steer ({FULL}): {wall:.0f}s wall ({cpu:.0f} CPU-s): model load "
              f"and data {wall - w['total']:.0f}s, hidden states {w['hidden_states']:.0f}s, "
              f"{FULL['steps']} steps {w['train']:.0f}s, final evaluation "
              f"{w['final_eval']:.0f}s.")
        chk = res.metrics.get("dev_check", {})
        if chk:
            print(f"Dev check: positive texts loss {chk['positive']['0']:.4f} at s=0 -> "
                  f"{chk['positive']['+5']:.4f} at +5; negative {chk['negative']['0']:.4f} -> "
                  f"{chk['negative']['-5']:.4f} at -5.")
    return 0


def options(args) -> int:
    """Step cost of our trainer per option, same batches, interleaved."""
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cfg = TrainConfig(model=args.model, rank=args.rank, batch_size=args.batch_size,
                      max_length=args.max_length, steps=args.steps, head_dtype="float32")
    data = preset_data_config("detox", args.data, max_examples=args.texts, dev_max_per_side=1)
    prep = prepare(cfg, load_dataset(data, cfg.seed), log)
    t, cpu = time.perf_counter(), time.process_time()
    hs = compute_hidden(prep.model, prep.tokenizer, prep.train_ids, prep.train_sides,
                        cache_dtype=torch.bfloat16, batch_tokens=cfg.cache_batch_tokens,
                        progress=True)
    hidden_s, hidden_cpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = int(hs.lengths().sum())
    sched = BatchSchedule(hs.num_texts, cfg.batch_size, cfg.seed)
    threads0 = torch.get_num_threads()
    variants = []
    for hd in (torch.bfloat16, torch.float32):
        for st in (None, 512, 256):
            variants.append((hd, st, threads0))
    if threads0 > 1:
        variants.append((torch.bfloat16, None, 1))
    lms = {v: LMSteer(prep.model, cfg.rank, cfg.domain_rank, cfg.epsilon, cfg.init_std,
                      cfg.seed) for v in variants}
    opts = {v: torch.optim.Adam(lm.factor_params(), lr=cfg.lr) for v, lm in lms.items()}
    times: dict = {v: [] for v in variants}
    cpus: dict = {v: [] for v in variants}
    gemm: dict = {}
    ntok = []
    for step in range(args.steps + 1):
        idx = sched.indices(step)
        c0, t0, s0 = hs.batch(idx)
        ntok.append(len(t0))
        for v in variants:
            hd, st, th = v
            torch.set_num_threads(th)
            c, tg, sg = c0, t0, s0
            if st is not None and len(tg) > st:
                g = torch.Generator().manual_seed(step)
                sel = torch.randperm(len(tg), generator=g)[:st].sort().values
                c, tg, sg = c[sel], tg[sel], sg[sel]
            a, ac = time.perf_counter(), time.process_time()
            opts[v].zero_grad()
            lms[v].loss_backward(c, tg, sg, head_dtype=hd, chunk_tokens=cfg.chunk_tokens)
            opts[v].step()
            if step > 0:
                times[v].append(time.perf_counter() - a)
                cpus[v].append(time.process_time() - ac)
            if step == 1 and th == threads0:  # the head GEMM alone (the forward's [n, V])
                lm = lms[v]
                w = lm.head.w(hd)
                m = lm.steer_logits_matrix(hd).detach()
                b = torch.cat([w, m.T], 1)
                x = torch.cat([c.to(hd), torch.zeros(len(c), m.shape[0], dtype=hd)], 1)
                a = time.perf_counter()
                for _ in range(3):
                    x @ b.T
                gemm[v] = (time.perf_counter() - a) / 3
        torch.set_num_threads(threads0)
        log(f"step {step}: " + ", ".join(f"{v[0]} {v[1]} {v[2]}t {times[v][-1]:.2f}s"
                                        for v in variants if times[v]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n### Step cost per option (detox, batch {cfg.batch_size} texts = "
          f"{statistics.mean(ntok[1:]):.0f} tokens on average, max length {cfg.max_length}, "
          f"rank {cfg.rank} + domain {cfg.rank}, median of {args.steps} steps, interleaved)\n")
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}; load average {load:.1f} at the end (shared machine: "
          "wall times inflated; CPU seconds are the process's own).\n")
    print("| head dtype | tokens/step | threads | median s/step (wall) | median CPU-s/step | "
          "head forward GEMM share | 1,000 steps (wall) |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        hd, st, th = v
        med = statistics.median(times[v])
        share = f"{gemm[v] / med:.0%}" if v in gemm else ""
        print(f"| {str(hd).replace('torch.', '')} | {st or 'all'} | {th} | {med:.3f} | "
              f"{statistics.median(cpus[v]):.3f} | {share} | {med * 1000 / 60:.1f} min |")
    print(f"\nHidden-state pass (bf16 model): {tokens} tokens of {hs.num_texts} texts in "
          f"{hidden_s:.1f}s wall, {hidden_cpu:.1f} CPU-s ({tokens / hidden_s:.0f} tokens/s).")
    return 0


#: The shipped detox recipe (steers/train_all.sh).
FULL = dict(steps=200, batch_size=32, max_length=64, max_examples=500, dev_max=100)

if __name__ == "__main__":
    sys.exit(main())
