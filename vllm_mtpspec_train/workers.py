"""Where the training loop runs: a Ray Train worker (the job as it ships), or this process
alone without Ray (`runner: "local"`), for a machine that has torch and the model and no Ray,
such as a GPU box the code is carried to. The loop (train.train_loop_per_worker) asks the
same things of either, so the two run the same steps on the same data.
"""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import torch


class RayWorker:
    """A Ray Train worker: its rank, device, checkpoints and reports are Ray Train's."""

    def __init__(self, use_gpu: bool) -> None:
        import ray.train
        import ray.train.torch

        self._train, self._torch = ray.train, ray.train.torch
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device() if use_gpu else torch.device("cpu")

    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        return self._torch.prepare_model(module)

    def latest_checkpoint(self):
        return self._train.get_checkpoint()

    def report(self, metrics: dict, folder: Path | None) -> None:
        """Every worker reports; rank 0 hands over the checkpoint folder it wrote."""
        checkpoint = self._train.Checkpoint.from_directory(str(folder)) if folder is not None else None
        self._train.report(metrics, checkpoint=checkpoint)

    def dataset_shard(self, name: str):
        return self._train.get_dataset_shard(name)


class LocalCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def as_directory(self):
        yield str(self.path)


class LocalWorker:
    """The one worker of a run without Ray. Checkpoints are folders under `folder`, the last
    `keep` of them kept; a run started again with the same name resumes from the newest, as a
    Ray Train run of the same name does."""

    rank, world_size = 0, 1
    keep = 2

    def __init__(self, folder: Path, use_gpu: bool) -> None:
        if use_gpu and not torch.cuda.is_available():
            raise RuntimeError("use_gpu was asked of a local run, and torch sees no CUDA device here")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.device = torch.device("cuda" if use_gpu else "cpu")

    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(self.device)

    def _checkpoints(self) -> list[Path]:
        return sorted(p for p in self.folder.glob("checkpoint_*") if (p / "state.pt").is_file())

    def latest_checkpoint(self) -> LocalCheckpoint | None:
        found = self._checkpoints()
        return LocalCheckpoint(found[-1]) if found else None

    def report(self, metrics: dict, folder: Path | None) -> None:
        if folder is None:
            return
        # Copied whole under a temporary name, then renamed: a run killed while it copies
        # leaves no half checkpoint to resume from.
        final = self.folder / f"checkpoint_{metrics['step']:09d}"
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(folder, partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in self._checkpoints()[:-self.keep]:
            shutil.rmtree(old)

    def dataset_shard(self, name: str):
        raise RuntimeError("a local run reads answer files (data_source 'online'); training shards stream "
                           "through Ray Data, which needs runner 'ray'")
