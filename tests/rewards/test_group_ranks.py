"""``score_groups`` on 2 gloo processes: groups split between the ranks get one process's values exactly,
and a group reward that raises on one rank raises on both (neither waits in a collective)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.rewards.group import PairwiseWinRate, RankReward, score_groups

N, GROUP = 12, 4
# The one-process order of a step's samples: groups 0-2 dealt over both ranks (rank 0 holds 0-5).
IDS = torch.tensor([2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2])


class Gloo:
    """The strategy side of DataParallel on a plain gloo group: an all-gather that stacks (Lightning's
    strategies do the same; none is built outside a Trainer here)."""

    def all_gather(self, x: torch.Tensor, group=None) -> torch.Tensor:
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)


class RaisesOnRankOne:
    scores_groups = True

    def __call__(self, images, prompts, metadata, group_ids):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("the judge on rank 1 is down")
        return torch.zeros(len(group_ids))


def _batch() -> tuple[torch.Tensor, list[str], list[dict]]:
    images = torch.rand(N, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    return images, [f"prompt {int(g)}" for g in IDS], [{"group": int(g)} for g in IDS]


def _rewards() -> dict[str, object]:
    # jpeg size: a per-sample score of the images (the judge rounds them to uint8 first, as it travels)
    return {
        "win": PairwiseWinRate(judge="reward", judge_config={"reward": "jpeg_compressibility"}),
        "rank": RankReward(reward="jpeg_compressibility"),
    }


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)  # a forked child starts no OpenMP team of its parent's
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        dp = DataParallel(rank=rank, size=2, strategy=Gloo())
        images, prompts, metadata = _batch()
        rows = slice(rank * N // 2, (rank + 1) * N // 2)
        values = {}
        for name, reward in _rewards().items():
            scored = score_groups(name, reward, images[rows], prompts[rows], metadata[rows], IDS[rows], dp)
            values[name] = scored.components[name].tolist()
        try:
            score_groups(
                "broken", RaisesOnRankOne(), images[rows], prompts[rows], metadata[rows], IDS[rows], dp
            )
            values["raised"] = ""
        except RuntimeError as err:
            values["raised"] = str(err)
        Path(out, f"rank{rank}.json").write_text(json.dumps(values))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_groups_split_over_two_ranks_score_as_one_process(tmp_path: Path) -> None:
    # fork: the workers start with this process's imports (a spawned one re-imports torch and the package)
    mp.start_processes(
        _worker, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, start_method="fork"
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    images, prompts, metadata = _batch()
    for name, reward in _rewards().items():
        one = score_groups(name, reward, images, prompts, metadata, IDS, DataParallel()).components[name]
        assert ranks[0][name] + ranks[1][name] == one.tolist()  # exactly: the same groups, the same order
        assert torch.isfinite(one).all()
    assert "the judge on rank 1 is down" in ranks[1]["raised"]
    assert "raised on data-parallel rank(s) [1]" in ranks[0]["raised"]
