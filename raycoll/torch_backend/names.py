"""The name and description torch gives each process group, kept by raycoll's torch group.

torch's functional collectives (``torch.ops._c10d_functional.*``, behind FSDP2's
``fully_shard``, DTensor and ``DeviceMesh``) name a group by ``group.group_name`` and find it
again in c10d's registry. A C++ ``ProcessGroup`` keeps that name in its backends
(``ProcessGroup::getGroupName`` raises "ProcessGroup name not set" when it has none); a
Python ``ProcessGroup`` subclass has no backends, but torch's pybind trampoline
(``PyProcessGroup``) forwards ``getGroupName``/``setGroupName`` and
``getGroupDesc``/``setGroupDesc`` to Python overrides of those names: this mixin is them.
It imports nothing from torch.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["GroupNames"]


class GroupNames:
    """Mixin for a ``torch.distributed.ProcessGroup`` subclass: the name torch's
    ``_new_process_group_helper`` sets (``pg._set_group_name``) and ``pg.group_name`` /
    c10d's C++ read back, and likewise the description."""

    _torch_group_name: Optional[str] = None
    _torch_group_desc: str = ""

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        """Keep the name torch registered this group under."""
        self._torch_group_name = str(name)

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        """The name torch registered this group under (as c10d's, an error before it did)."""
        if self._torch_group_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._torch_group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        """Keep torch's description of this group."""
        self._torch_group_desc = str(desc)

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        """torch's description of this group ("" until torch sets one, as c10d's)."""
        return self._torch_group_desc
