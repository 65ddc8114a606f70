"""A user's own Triton cache manager (``TRITON_CACHE_MANAGER=triton_user_manager:Recording``):
Triton's file manager that records each call in the file ``RECORDED_CALLS`` names."""

import os

from triton.runtime.cache import FileCacheManager


class Recording(FileCacheManager):
    def _record(self, call: str, filename: str) -> None:
        with open(os.environ["RECORDED_CALLS"], "a") as f:
            f.write(f"{call} {self.key} {filename}\n")

    def get_group(self, filename):
        self._record("get_group", filename)
        return super().get_group(filename)

    def get_file(self, filename):
        self._record("get_file", filename)
        return super().get_file(filename)
