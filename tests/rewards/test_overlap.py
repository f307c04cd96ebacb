"""RewardQueue: chunks scored in a worker thread give what one call on the whole batch gives; the
rewards that must stay on the caller's thread, a reward that raises, and a rollout that fails."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import Tensor

from lit_flowgrpo.rewards import MultiReward
from lit_flowgrpo.rewards.overlap import THREAD_NAME, RewardQueue

CHUNKS = [slice(0, 4), slice(4, 8), slice(8, 10)]


class Recording:
    """A per-sample dict-valued reward that fails (NaN) on dark images and notes where it ran."""

    primary = "bright"

    def __init__(self, thread_safe: bool = True) -> None:
        self.thread_safe = thread_safe
        self.calls: list[tuple[str, int]] = []

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        self.calls.append((threading.current_thread().name, images.shape[0]))
        bright = images.mean(dim=(1, 2, 3))
        length = torch.tensor([float(len(p)) + m["bonus"] for p, m in zip(prompts, metadata, strict=True)])
        return {"bright": torch.where(bright > 0.45, bright, torch.nan), "length": length}


def red(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
    return images[:, 0].flatten(1).amax(dim=1)


@pytest.fixture
def batch() -> tuple[Tensor, list[str], list[dict]]:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(10, 3, 16, 16, generator=generator) * torch.linspace(0.6, 1.2, 10).view(10, 1, 1, 1)
    prompts = [f"prompt {'x' * i}" for i in range(10)]
    return images.clamp(0, 1), prompts, [{"bonus": 0.5 * i} for i in range(10)]


def multi(overlap: bool = True, **recording: bool) -> MultiReward:
    weights = {"jpeg_incompressibility": 0.5, "rec": 2.0, "rec/length": 0.1, "red": -1.0}
    return MultiReward(weights, rewards={"rec": Recording(**recording), "red": red}, overlap=overlap)


def overlapped(reward: MultiReward, images: Tensor, prompts: list[str], metadata: list[dict]):
    with RewardQueue(reward, prompts, metadata) as scores:
        for rows in CHUNKS:  # as Sampler.rollout hands them on
            scores.submit(rows, images[rows].clone())
        return scores.result(images)


def live_workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def test_chunks_give_the_whole_batch_values(batch) -> None:
    images, prompts, metadata = batch
    whole = multi()(images, prompts, metadata)
    reward = multi()
    out = overlapped(reward, images, prompts, metadata)

    assert torch.isnan(whole.total).any() and torch.isfinite(whole.total).any()  # both kinds present
    torch.testing.assert_close(out.total, whole.total, rtol=0, atol=0, equal_nan=True)
    assert list(out.components) == list(whole.components)
    for key, value in whole.components.items():
        torch.testing.assert_close(out.components[key], value, rtol=0, atol=0, equal_nan=True)
    assert out.failures == whole.failures and out.failures["rec"] > 0
    assert out.latency_s.keys() == whole.latency_s.keys()
    assert out.exposed_s is not None and whole.exposed_s is None
    logs = out.log_dict()
    assert logs["reward/exposed_s"] == out.exposed_s
    assert logs["reward/failure_rate"] == whole.log_dict()["reward/failure_rate"]
    # Every chunk, in order, away from this thread (in the worker, or in a pool the worker runs).
    main = threading.current_thread().name
    assert [b for _, b in reward.rewards["rec"].calls] == [4, 4, 2]
    assert all(name != main for name, _ in reward.rewards["rec"].calls)
    assert not live_workers()


def test_a_reward_that_is_not_thread_safe_is_scored_on_the_callers_thread(batch) -> None:
    images, prompts, metadata = batch
    reward = multi(thread_safe=False)
    out = overlapped(reward, images, prompts, metadata)
    whole = multi()(images, prompts, metadata)
    torch.testing.assert_close(out.total, whole.total, rtol=0, atol=0, equal_nan=True)
    # Once, on the whole batch, after the rollout, on this thread; the other rewards ran per chunk.
    assert reward.rewards["rec"].calls == [(threading.current_thread().name, 10)]
    assert out.failures == whole.failures


def test_overlap_off_scores_the_whole_batch_after_the_rollout(batch) -> None:
    images, prompts, metadata = batch
    reward = multi(overlap=False)
    with RewardQueue(reward, prompts, metadata) as scores:
        for rows in CHUNKS:
            scores.submit(rows, images[rows])
        assert not live_workers()  # nothing started
        out = scores.result(images)
    assert [b for _, b in reward.rewards["rec"].calls] == [10]  # once, on the whole batch
    torch.testing.assert_close(out.total, multi()(images, prompts, metadata).total, equal_nan=True)
    assert out.exposed_s is not None  # the whole reward is exposed


def test_a_reward_that_raises_stops_the_step_naming_the_reward_and_samples(batch) -> None:
    images, prompts, metadata = batch

    class Broken:
        def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
            if "x" * 5 in prompts[-1]:  # the second chunk: samples 4..7
                raise RuntimeError("scorer crashed")
            return images.mean(dim=(1, 2, 3))

    reward = MultiReward({"broken": 1.0, "red": 0.0}, rewards={"broken": Broken(), "red": red})
    with pytest.raises(RuntimeError, match="scorer crashed") as caught:
        overlapped(reward, images, prompts, metadata)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "reward 'broken'" in notes and "samples 4:8" in notes
    assert not live_workers()
    # Scored after the rollout, the same reward stops the step the same way.
    with pytest.raises(RuntimeError, match="scorer crashed") as caught:
        reward(images, prompts, metadata)
    assert "reward 'broken'" in "\n".join(caught.value.__notes__)


def test_the_next_chunk_raises_what_an_earlier_chunk_raised(batch, wait_for) -> None:
    images, prompts, metadata = batch

    def broken(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        raise ValueError("bad reward")

    reward = MultiReward({"broken": 1.0}, rewards={"broken": broken})
    with RewardQueue(reward, prompts, metadata) as scores:
        scores.submit(CHUNKS[0], images[CHUNKS[0]])
        first = scores._chunks[0][2]
        assert wait_for(first.done)
        with pytest.raises(ValueError, match="bad reward"):
            scores.submit(CHUNKS[1], images[CHUNKS[1]])  # the rollout stops at its next chunk
    assert not live_workers()


def test_an_error_in_the_rollout_leaves_no_worker_and_is_raised_unchanged(batch) -> None:
    images, prompts, metadata = batch
    started, release, calls = threading.Event(), threading.Event(), []

    def slow(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        calls.append(images.shape[0])
        started.set()
        release.wait(30)  # a bound for a broken test, not a timing
        return images.mean(dim=(1, 2, 3))

    def release_once(dropped) -> None:
        # The first chunk is held until the error has dropped the second (a bounded poll, no clock).
        for _ in range(3000):
            if dropped.cancelled():
                break
            threading.Event().wait(0.01)
        release.set()

    reward = MultiReward({"slow": 1.0}, rewards={"slow": slow})
    error = RuntimeError("the sampler failed")
    with pytest.raises(RuntimeError) as caught, RewardQueue(reward, prompts, metadata) as scores:
        scores.submit(CHUNKS[0], images[CHUNKS[0]])
        scores.submit(CHUNKS[1], images[CHUNKS[1]])  # queued behind the first
        second = scores._chunks[1][2]
        assert started.wait(30)
        threading.Thread(target=release_once, args=(second,), daemon=True).start()
        raise error
    assert caught.value is error and not getattr(error, "__notes__", None)
    assert second.cancelled() and calls == [4]  # the one being scored finished; the queued one dropped
    assert not live_workers() and not scores._chunks


def test_the_worker_scores_under_the_callers_autocast(batch) -> None:
    images, prompts, metadata = batch
    seen = []

    def projected(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        weight = torch.linspace(-1, 1, 16 * 16)
        return (images[:, 0].flatten(1) @ weight).float()  # bf16 under autocast: other values

    reward = MultiReward({"p": 1.0}, rewards={"p": projected})
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as a trainer's bf16-mixed precision
        whole = reward(images, prompts, metadata)
        out = overlapped(reward, images, prompts, metadata)
    assert seen == [True] * 4
    torch.testing.assert_close(out.total, whole.total, rtol=0, atol=0)
    assert not torch.equal(whole.total, reward(images, prompts, metadata).total)


def test_chunks_must_cover_the_batch(batch) -> None:
    images, prompts, metadata = batch
    with RewardQueue(multi(), prompts, metadata) as scores:
        scores.submit(CHUNKS[0], images[CHUNKS[0]])
        with pytest.raises(ValueError, match=r"do not cover its 10 samples"):
            scores.result(images)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_reward_runs_on_a_side_stream_after_the_decode() -> None:
    device = torch.device("cuda")
    streams = []

    def on_gpu(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        streams.append(torch.cuda.current_stream(images.device))
        return (images.float() ** 2).mean(dim=(1, 2, 3))

    generator = torch.Generator(device=device).manual_seed(0)
    prompts, metadata = ["p"] * 10, [{}] * 10
    reward = MultiReward({"g": 1.0}, rewards={"g": on_gpu})
    with RewardQueue(reward, prompts, metadata) as scores:
        chunks = []
        for rows in CHUNKS:
            # A long queue of kernels that produce the chunk: the reward must see their result.
            x = torch.rand(rows.stop - rows.start, 3, 256, 256, generator=generator, device=device)
            for _ in range(50):
                x = (x * 1.0001).clamp(0, 1)
            chunks.append(x)
            scores.submit(rows, x)
        images = torch.cat(chunks)
        out = scores.result(images)
    expected = (images.float() ** 2).mean(dim=(1, 2, 3)).cpu()
    # A chunk's rows reduce in another launch shape than the whole batch's: the sums may round
    # differently, by about log2(3·256·256) ≈ 18 fp32 roundings (1e-6 relative). Reading the images
    # before the 50 kernels that produce them finished would be off by up to 0.5% (1.0001⁵⁰).
    torch.testing.assert_close(out.total, expected, rtol=1e-5, atol=0)
    assert streams and all(s != torch.cuda.default_stream(device) for s in streams)
