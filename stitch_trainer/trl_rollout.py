"""TRL's GRPO with rollouts from Stitch-following engines: a `rollout_func` for
`trl.GRPOTrainer(rollout_func=...)` that generates through the engines' OpenAI API.

The trainer publishes every step (`stitch_trainer.hf.StitchCallback`); `FleetRollout` asks the
engines for completions with ``X-Stitch-Min-Version: latest - max_staleness`` (and
``X-Stitch-Wait``, so an engine still applying waits instead of refusing), and hands TRL what its
hook takes: ``prompt_ids``, ``completion_ids``, ``logprobs`` (the engine's own, per sampled
token), ``env_mask`` (TRL's per-token loss mask: tokens older than the staleness bound are left
out), and, as extra fields TRL forwards to the reward functions, ``stitch_versions`` (the version
that generated each token, from the response's ``stitch.choice_version_spans``) and
``stitch_staleness`` (``latest - version`` per token).

Prompts: plain strings go to ``/v1/completions``, conversations (lists of messages) to
``/v1/chat/completions``; token ids come from vLLM's ``return_token_ids``. TRL hands the hook the
batch as its sampler made it, each prompt repeated ``num_generations`` times in a row: each run
of equal prompts is one request with ``n`` choices, and requests are spread over the engines
round-robin, concurrently.

Needs the ``openai`` client (the official one; every vLLM install has it). TRL applies its own
importance-sampling correction to engine logprobs only on its vLLM paths (``use_vllm=True``), so
with this hook the logprobs are carried but TRL does not reweight by them: use ``env_mask`` and
``max_staleness`` to bound off-policy tokens, or the truncated-IS loss of
``examples/grpo_async.py`` (docs/rl.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from stitch_core.errors import StitchError
from stitch_core.serve import protocol

__all__ = ["FleetRollout", "RolloutError"]


class RolloutError(StitchError, RuntimeError):
    """An engine's answer cannot feed the trainer (no token ids, no logprobs, no version spans)."""


@dataclass
class FleetRollout:
    """A TRL ``rollout_func`` over following engines (see the module docstring).

    `latest`: the version the trainer holds now. By default the trainer's ``global_step``: the
    recipe publishes v0 before training and `StitchCallback` (``every=1``) one version per step,
    so after step k the trainer holds version k (queued, maybe still uploading: the engines wait
    for it within ``X-Stitch-Wait``). Give a callable when versions and steps do not line up.
    """

    urls: Sequence[str]
    model: str
    latest: Callable[[], int | None] | None = None
    max_staleness: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    api_key: str | None = None
    wait_s: float = 60.0
    timeout_s: float = 300.0
    sampling: dict[str, Any] = field(default_factory=dict)  # more request fields (top_p, seed…)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("FleetRollout needs at least one engine URL")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        from openai import OpenAI  # the official client; lazily, like every optional extra

        self._clients = [OpenAI(base_url=u.rstrip("/") + "/v1", api_key=self.api_key or "none",
                                timeout=self.timeout_s, max_retries=2) for u in self.urls]

    def __call__(self, prompts: list, trainer: Any = None) -> dict[str, list]:
        latest = (self.latest() if self.latest is not None
                  else trainer.state.global_step if trainer is not None else None) or 0
        floor = max(0, latest - self.max_staleness)
        groups = [(p, len(list(g))) for p, g in itertools.groupby(prompts, key=_key)]
        firsts = list(itertools.accumulate([0] + [n for _, n in groups[:-1]]))
        jobs = [(prompts[i], n) for i, (_, n) in zip(firsts, groups, strict=True)]
        pairs = list(zip(jobs, itertools.cycle(self._clients), strict=False))
        with ThreadPoolExecutor(max_workers=len(self._clients) * 2) as ex:
            answers = list(ex.map(lambda jc: self._generate(jc[1], *jc[0], floor), pairs))
        out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs",
                                                "env_mask", "stitch_versions",
                                                "stitch_staleness")}
        for samples in answers:
            for prompt_ids, ids, lps, versions in samples:
                staleness = [latest - v for v in versions]
                out["prompt_ids"].append(prompt_ids)
                out["completion_ids"].append(ids)
                out["logprobs"].append(lps)
                out["env_mask"].append([int(s <= self.max_staleness) for s in staleness])
                out["stitch_versions"].append(versions)
                out["stitch_staleness"].append(staleness)
        return out

    def _generate(self, client: Any, prompt: Any, n: int, floor: int) -> list[tuple]:
        headers = {protocol.MIN_VERSION_HEADER: str(floor),
                   protocol.WAIT_HEADER: str(self.wait_s)}
        common = dict(model=self.model, n=n, max_tokens=self.max_tokens,
                      temperature=self.temperature, extra_headers=headers)
        extra = {"return_token_ids": True, **self.sampling}
        if isinstance(prompt, str):
            r = client.completions.create(prompt=prompt, logprobs=0, extra_body=extra, **common)
        else:
            r = client.chat.completions.create(messages=prompt, logprobs=True, extra_body=extra,
                                               **common)
        body = r.model_dump()
        info = protocol.parse_stitch(body)
        if info is None:
            raise RolloutError(f"{self.model}: the answer has no `stitch` field (is the engine a "
                               "Stitch follower?)")
        samples = []
        for i, ch in enumerate(body["choices"]):
            ids = ch.get("token_ids")
            prompt_ids = ch.get("prompt_token_ids") or body.get("prompt_token_ids")
            lps = _logprobs(ch)
            versions = info.token_versions(i)
            if ids is None or prompt_ids is None:
                raise RolloutError("the engine returned no token ids (vLLM's return_token_ids)")
            if lps is None or len(lps) != len(ids):
                raise RolloutError(f"choice {i}: {len(ids)} tokens but logprobs {lps!r:.80}")
            if versions is None or len(versions) != len(ids):
                raise RolloutError(f"choice {i}: {len(ids)} tokens but version spans "
                                   f"{info.choice_version_spans!r:.80}")
            samples.append((list(prompt_ids), list(ids), lps, versions))
        return samples


def _key(prompt: Any) -> Any:
    """A hashable form of a prompt (a string, or a conversation's messages)."""
    return prompt if isinstance(prompt, str) else repr(prompt)


def _logprobs(choice: dict) -> list[float] | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if lp.get("token_logprobs") is not None:  # completions
        return [float(x) for x in lp["token_logprobs"]]
    if lp.get("content") is not None:  # chat completions
        return [float(c["logprob"]) for c in lp["content"]]
    return None
