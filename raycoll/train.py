"""Ray Train on raycoll: :class:`RaycollConfig`, a ``TorchConfig`` for ``TorchTrainer``.

::

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from raycoll.train import RaycollConfig

    TorchTrainer(train_fn, torch_config=RaycollConfig(),
                 scaling_config=ScalingConfig(num_workers=2)).fit()

Ray Train (v2, the default in Ray 2.60) places its worker actors, then calls its backend's
``on_start`` from the run's controller. :class:`_RaycollBackend` forms a raycoll group over
those actors from there with :func:`raycoll.create_group` (it reaches any actor class through
Ray's ``__ray_call__``; world rank = Ray Train's world rank = the order of the workers), then
runs ``torch.distributed.init_process_group("raycoll")`` in every worker, so ``train_fn`` is
the one it is on gloo: ``prepare_model`` (DDP), ``prepare_data_loader``, ``ray.train.report``.

Each worker group gets a group of its own name (``raytrain-<run>-<generation>``): after a
restart the new workers rendezvous with a new coordinator, and nothing of the old group can
be read. That coordinator is started ahead (:mod:`raycoll.coordinator.spare`): the first
when the backend reaches the controller, each next one once a group has formed; so forming
a group over the workers, at the start and at every restart, waits for no new process. The group is destroyed in ``on_shutdown``; when Ray Train aborts a worker group (a
worker died) it does not call the backend, so ``on_start`` of the next generation, and the
``__del__`` of the backend with the controller, destroy what is left of the previous one.

Ray Train and torch are imported lazily by users of this module (it imports them at the top:
import it only where the ``train`` extra is installed).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional

import ray
from ray.train.backend import Backend
from ray.train.torch import TorchConfig

import raycoll
from raycoll.coordinator import spare

__all__ = ["RaycollConfig", "group_name", "get_group"]

logger = logging.getLogger(__name__)

#: The worker's environment variable that names its raycoll group (set by the backend).
GROUP_ENV = "RAYCOLL_TRAIN_GROUP"


@dataclass
class RaycollConfig(TorchConfig):
    """``TorchTrainer(..., torch_config=RaycollConfig())``: torch.distributed on raycoll.

    - ``options``: raycoll group options (a dict or :class:`raycoll.GroupOptions`, as for
      :func:`raycoll.create_group`), validated here, when the config is built;
    - ``raycoll_backend``: raycoll's device -> backend map for the group (``None``: the
      default, cpu -> objstore, cuda -> nccl where available; e.g. ``"cpu:objstore"``);
    - ``timeout_s`` (from ``TorchConfig``): the rendezvous and collective timeout.

    ``backend`` is always ``"raycoll"`` (torch's name of the backend); ``init_method`` is
    unused: raycoll rendezvous through Ray.
    """

    backend: Optional[str] = "raycoll"
    options: Any = None
    raycoll_backend: Optional[str] = None
    _checked: raycoll.GroupOptions = field(default_factory=raycoll.GroupOptions, repr=False)

    def __post_init__(self) -> None:
        if self.backend != "raycoll":
            raise ValueError(f"RaycollConfig(backend={self.backend!r}): the torch backend of "
                             "RaycollConfig is 'raycoll'; for gloo or nccl use "
                             "ray.train.torch.TorchConfig(backend=...)")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) \
                or self.timeout_s <= 0:
            raise ValueError(f"RaycollConfig(timeout_s=...) must be a number of seconds > 0, "
                             f"got {self.timeout_s!r}")
        if self.raycoll_backend is not None:
            raycoll.BackendConfig(self.raycoll_backend)  # raises, naming the bad entry
        self._checked = raycoll.GroupOptions.of(self.options)  # raises, naming the option

    @property
    def backend_cls(self) -> type:
        return _RaycollBackend

    def to_dict(self) -> Dict[str, Any]:
        out = super().to_dict()
        out.update(options=self.options, raycoll_backend=self.raycoll_backend)
        return out


def group_name() -> str:
    """In a Ray Train worker under :class:`RaycollConfig`: the name of its raycoll group."""
    name = os.environ.get(GROUP_ENV)
    if not name:
        raise RuntimeError("raycoll.train.group_name() runs in a Ray Train worker of a "
                           "TorchTrainer with torch_config=RaycollConfig(); this process has "
                           f"no {GROUP_ENV}")
    return name


def get_group() -> raycoll.ProcessGroup:
    """In a Ray Train worker under :class:`RaycollConfig`: its raycoll group (e.g. for
    ``get_group().transport_name``)."""
    return raycoll.get_group(group_name())


# ------------------------------------------------------------------ run in the workers
def _export(name: str) -> None:
    """Each worker: the env vars torch code reads (as Ray's own backend sets them), and the
    raycoll group's name."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()
    os.environ[GROUP_ENV] = name


def _init_torch(timeout_s: float) -> None:
    """Each worker: torch.distributed's default group on this worker's raycoll group."""
    import torch.distributed as dist

    dist.init_process_group("raycoll", timeout=timedelta(seconds=timeout_s))


def _shutdown_torch() -> None:
    """Each worker: torch's default group destroyed (raycoll's group goes with
    :func:`raycoll.destroy_group`, from the controller)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.pop(GROUP_ENV, None)


# ------------------------------------------------------------------ run in the controller
class _RaycollBackend(Backend):
    """Ray Train's backend for :class:`RaycollConfig`; one instance per run (its controller),
    living across the run's restarts."""

    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        self._run = uuid.uuid4().hex[:8]
        self._generation = 0
        self._live: List[str] = []  # groups formed here and not destroyed yet

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Ray Train builds the backend in the driver and ships it to the run's controller
        actor, where it forms every group: arriving there, it starts the coordinator of the
        first group ahead (see :mod:`raycoll.coordinator.spare`), which comes up while Ray
        Train places the workers."""
        self.__dict__.update(state)
        try:
            if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
                spare.refill()
        except Exception:  # noqa: BLE001 - only a head start: on_start forms the group anyway
            logger.debug("raycoll: starting a coordinator ahead failed", exc_info=True)

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        self._destroy_all()  # an aborted generation's group: Ray Train does not shut it down
        self._generation += 1
        name = f"raytrain-{self._run}-{self._generation}"
        actors = [w.actor for w in worker_group.get_workers()]
        worker_group.execute(_export, name)
        ahead = spare.pending() is not None
        start = time.perf_counter()
        raycoll.create_group(actors, backend=backend_config.raycoll_backend, group_name=name,
                             timeout=float(backend_config.timeout_s),
                             options=backend_config._checked)
        self._live.append(name)
        logger.info("raycoll group %r formed over %d Ray Train workers in %.3f s (coordinator "
                    "started ahead: %s)", name, len(actors), time.perf_counter() - start, ahead)
        worker_group.execute(_init_torch, float(backend_config.timeout_s))

    def on_training_start(self, worker_group: Any, backend_config: Any) -> None:
        pass  # Train v2: everything happened in on_start

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        try:
            ray.get(worker_group.execute_async(_shutdown_torch), timeout=30)
        except Exception:  # noqa: BLE001 - a dead worker: its peers' groups go below anyway
            logger.warning("raycoll: torch shutdown in a worker failed", exc_info=True)
        finally:
            self._destroy_all()

    def _destroy_all(self) -> None:
        while self._live:
            name = self._live.pop()
            try:
                raycoll.destroy_group(name)
            except Exception:  # noqa: BLE001 - best effort: the actors may be gone
                logger.warning("raycoll: destroying group %r failed", name, exc_info=True)

    def __del__(self) -> None:
        try:
            self._destroy_all()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
