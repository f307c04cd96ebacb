"""Scoring a rollout while it is sampled: each chunk is scored as soon as it is decoded.

The rollout samples its batch in chunks of ``--model.init_args.sampler.batch_size`` samples and
decodes each. :class:`RewardQueue` hands every decoded chunk to one worker thread, which runs the
reward on it while the sampler draws the next chunk; a remote reward's requests are in flight
meanwhile. Once the rollout is done the step waits only for what is left: the last chunk's reward,
and the rewards that must run on the training loop's thread (``thread_safe = False``), scored then
on the whole batch. With one chunk (``batch_size`` null or the whole batch) nothing can overlap.

The output is that of one :class:`~lit_flowgrpo.rewards.base.MultiReward` call on the whole batch:
rewards are per-sample functions (the contract in :mod:`lit_flowgrpo.rewards.base`), so each chunk's
values are the batch's values of its samples; they are joined in sample order, failures are counted
on the joined components, and a reward's latency is the sum over its chunks. A remote reward sees one
call per chunk: its ``max_consecutive_failures`` counts chunks.

Failure policy, the same as scoring after the rollout: a sample a reward cannot score is NaN, counted
in ``reward/failure_rate``; a reward that *raises* stops the step. Its exception (a
:class:`~lit_flowgrpo.rewards.remote.RemoteRewardError`, a wrong output shape, a bug) is raised again
in the training step, at the next chunk or in :meth:`RewardQueue.result`, with notes naming the reward
and the samples; the chunks not yet begun are dropped. Whatever leaves the step (that exception, one
from the sampler, a ``KeyboardInterrupt``), the queue's ``with`` block drops the chunks not begun and
waits for the one being scored (bounded by that reward's own timeouts), so no worker thread outlives
the step. SIGTERM needs nothing more: Lightning stops only between steps, when the queue is done.

On CUDA the worker runs on its own stream, which first waits for an event recorded on the sampler's
stream right after the chunk's decode: a GPU reward reads finished images and never races the
sampler. The queue holds each chunk's images until its scoring has finished on that stream. The
worker scores without autograd, under the caller's autocast (autocast is per thread), so a trainer's
mixed precision applies to both ways alike. PyTorch's attention-kernel switches are process-wide,
though: a GPU reward's attention runs under those of a transformer forward running at the same time,
which always leave the math kernel on, so the reward always has one
(:func:`lit_flowgrpo.attention.sdpa_backends`). Validation scores its samples after sampling them.

A reward that scores whole groups (``scores_groups``) is scored once the rollout is done: given the
batch's group ids and data-parallel peers, :meth:`RewardQueue.result` scores it on this thread, with
its groups assembled across ranks (:func:`lit_flowgrpo.rewards.group.score_groups`). Its per-sample
part, a ``prepare`` (a rank reward's base score), runs chunk by chunk in the worker like any reward;
what it raises is handed to ``score_groups``, which raises it on every rank alike.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.rewards.base import MultiReward, RewardOutput, Scored, note, scores_groups, thread_safe
from lit_flowgrpo.rewards.group import prepare_inputs, score_groups

__all__ = ["THREAD_NAME", "RewardQueue"]

#: Name prefix of the worker thread (one per training step).
THREAD_NAME = "reward-overlap"

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_side_streams_lock = threading.Lock()


class RewardQueue:
    """Scores a rollout chunk by chunk in a worker thread, and returns one output for the batch.

    Use it as a context manager around the rollout, with :meth:`submit` as the rollout's ``on_chunk``::

        with RewardQueue(reward, prompts, metadata) as scores:
            trajectory, images = sampler.rollout(..., on_chunk=scores.submit)
            rewards = scores.result(images)

    Args:
        reward: the rewards; its ``overlap`` setting says whether chunks are scored during the rollout.
        prompts: the whole batch's, one per sample.
        metadata: the whole batch's, one per sample.
        group_ids: (B,) the group of each sample, for the rewards that score whole groups (without
            them such a reward is NaN).
        dp: the data-parallel peers those groups are spread over (``None``: this process alone).
        sources: the whole batch's conditioning images, one list per sample (``None``: text-only), for the
            rewards that declare ``uses_sources``.
    """

    def __init__(
        self,
        reward: MultiReward,
        prompts: Sequence[str],
        metadata: Sequence[dict],
        group_ids: Tensor | None = None,
        dp: DataParallel | None = None,
        sources: Sequence[Sequence[Tensor]] | None = None,
    ) -> None:
        self.reward = reward
        self.prompts, self.metadata = list(prompts), list(metadata)
        self.sources = None if sources is None else list(sources)
        self.group_ids, self.dp = group_ids, dp or DataParallel()
        overlap = bool(getattr(reward, "overlap", False))
        #: The rewards scored chunk by chunk in the worker; the others wait for :meth:`result`.
        self.overlapped = [
            n for n, r in reward.rewards.items() if overlap and thread_safe(r) and not scores_groups(r)
        ]
        #: The rewards that score whole groups, in :meth:`result`, when the groups are known.
        self.grouped = [n for n, r in reward.rewards.items() if group_ids is not None and scores_groups(r)]
        #: Those of them whose per-sample ``prepare`` runs chunk by chunk in the worker.
        self.prepared = [
            n
            for n in self.grouped
            if overlap and thread_safe(reward.rewards[n]) and hasattr(reward.rewards[n], "prepare")
        ]
        self._pool: ThreadPoolExecutor | None = None
        self._chunks: list[tuple[slice, Tensor, Future[_Chunk]]] = []
        # Autocast is per thread: the worker scores under the caller's (a trainer's mixed precision),
        # as the rewards scored here after the rollout do.
        self._autocast = [
            (d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)
        ]

    @classmethod
    def for_batch(cls, reward: MultiReward, batch: Any, dp: DataParallel) -> RewardQueue:
        """The queue of a training step's ``batch`` (its prompts, metadata, group ids and conditioning
        images) on ``dp``."""
        conditions = getattr(batch, "conditions", None)
        sources = None if conditions is None else [c.images for c in conditions]
        return cls(reward, batch.prompts, batch.metadata, batch.group_ids, dp, sources)

    def __enter__(self) -> RewardQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the chunks not begun, wait for the one being scored, end the worker thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._chunks = []

    def submit(self, rows: slice, images: Tensor) -> None:
        """Queue the decoded chunk ``images`` of samples ``rows`` (the rollout's ``on_chunk``).

        Raises:
            Exception: what a reward raised on an earlier chunk (the rollout stops there).
        """
        if not self.overlapped and not self.prepared:
            return
        self._raise_failure()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        ready = None
        if images.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(images.device))  # after the decode's kernels
        future = self._pool.submit(self._score, rows, images, ready)
        self._chunks.append((rows, images, future))

    def result(self, images: Tensor) -> RewardOutput:
        """Wait for every chunk, score the rewards that run here, and return the batch's output.

        Args:
            images: the rollout's (B, 3, H, W) images, for the rewards scored on the whole batch.
        """
        start = time.perf_counter()
        batch = images.shape[0]
        done = [(rows, future.result()) for rows, _, future in self._chunks]
        parts = [(rows, chunk.scored) for rows, chunk in done]
        covered = [i for rows, _ in parts for i in range(batch)[rows]]
        if parts and covered != list(range(batch)):
            raise ValueError(
                f"the rollout handed on chunks of samples {[(r.start, r.stop) for r, _ in parts]}, "
                f"which do not cover its {batch} samples in order"
            )
        later = [
            n
            for n in self.reward.rewards
            if (not parts or n not in self.overlapped) and n not in self.grouped
        ]
        scored = (
            self.reward.score(images, self.prompts, self.metadata, names=later, sources=self.sources)
            if later
            else {}
        )
        for name in self.grouped:  # a collective each, in the same order on every rank
            reward = self.reward.rewards[name]
            inputs = _prepared(name, [chunk for _, chunk in done]) if done and name in self.prepared else None
            args = (images, self.prompts, self.metadata, self.group_ids, self.dp)
            scored[name] = score_groups(name, reward, *args, prepared=inputs)  # keyed by its name
        for name in self.reward.rewards:
            if name not in scored:
                scored[name] = _joined(name, [chunk[name] for _, chunk in parts])
        out = self.reward.combine({n: scored[n] for n in self.reward.rewards}, batch)
        out.exposed_s = time.perf_counter() - start
        self._chunks = []  # the images go with them
        return out

    def _raise_failure(self) -> None:
        for _, _, future in self._chunks:
            if future.done() and not future.cancelled() and future.exception() is not None:
                future.result()  # raises it

    def _score(self, rows: slice, images: Tensor, ready: torch.cuda.Event | None) -> _Chunk:
        prompts, metadata = self.prompts[rows], self.metadata[rows]
        sources = None if self.sources is None else self.sources[rows]
        try:
            with torch.no_grad(), _after(ready, images.device), contextlib.ExitStack() as autocast:
                for device_type, dtype in self._autocast:
                    autocast.enter_context(torch.autocast(device_type, dtype=dtype))
                scored = self.reward.score(images, prompts, metadata, names=self.overlapped, sources=sources)
                inputs = {}
                for name in self.prepared:  # its failure waits for score_groups, which every rank reaches
                    start = time.perf_counter()
                    made = prepare_inputs(name, self.reward.rewards[name], images, prompts, metadata)
                    inputs[name] = (made, time.perf_counter() - start)
                return _Chunk(scored, inputs)
        except Exception as err:
            note(
                err,
                f"while scoring samples {rows.start}:{rows.stop} of this rank's batch, beside the rollout",
            )
            raise


class _Chunk(NamedTuple):
    """What the worker made of one chunk: the per-sample rewards' outputs, and each group reward's
    prepared inputs (or what its ``prepare`` raised) with the seconds it took."""

    scored: dict[str, Scored]
    inputs: dict[str, tuple[Tensor | BaseException, float]]


def _prepared(name: str, chunks: list[_Chunk]) -> tuple[Tensor | BaseException, float]:
    """One group reward's prepared inputs of every chunk, joined in sample order (or the first failure)."""
    made = [chunk.inputs[name] for chunk in chunks]
    seconds = sum(s for _, s in made)
    failed = [m for m, _ in made if isinstance(m, BaseException)]
    return (failed[0] if failed else torch.cat([m for m, _ in made])), seconds


def _joined(name: str, chunks: list[Scored]) -> Scored:
    """One reward's chunk outputs joined in sample order; its latency is the sum over the chunks."""
    keys = list(chunks[0].components)
    for chunk in chunks[1:]:
        if list(chunk.components) != keys:
            raise ValueError(
                f"reward {name!r} returned components {list(chunk.components)} for one chunk of the rollout "
                f"and {keys} for another: a reward must return the same components for every batch"
            )
    components = {key: torch.cat([chunk.components[key] for chunk in chunks]) for key in keys}
    return Scored(components, sum(chunk.seconds for chunk in chunks))


@contextlib.contextmanager
def _after(ready: torch.cuda.Event | None, device: torch.device) -> Iterator[None]:
    """On CUDA: run the block on this device's side stream, once ``ready`` (the chunk's decode) has
    happened; on leaving, wait for the stream, so the chunk's images can be freed."""
    if ready is None:
        yield
        return
    stream = _side_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        stream.wait_event(ready)
        try:
            yield
        finally:
            stream.synchronize()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    # One stream per device for the process's life: the caching allocator keeps freed blocks per
    # stream, so a new stream every step would strand each step's reward memory.
    with _side_streams_lock:
        if device not in _side_streams:
            _side_streams[device] = torch.cuda.Stream(device)
        return _side_streams[device]
