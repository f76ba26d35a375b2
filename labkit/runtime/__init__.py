"""Layer 1, the runtime: real torch.distributed ranks that a notebook cell drives.

Imports from labkit only labkit.units and labkit.arguments; beside the standard
library, torch, cloudpickle, IPython (the cell's live view, `%%ranks`) and tqdm
(`progress` outside a labkit rank).

`Cluster` and `run` (cluster.py) drive ranks forked by a forkserver that has torch
imported already (forkserver.py); launch.py and results_io.py run the same worker
functions under torchrun. docs/design.md lists every module.
"""

from labkit.runtime import forkserver as _forkserver

_forkserver.prewarm()  # in a notebook: the rank forkserver imports torch meanwhile

from labkit.runtime.cluster import Cluster, default_cluster, run  # noqa: E402
from labkit.runtime.progress import progress  # noqa: E402
from labkit.runtime.results import (  # noqa: E402
    CallInterrupted,
    ClusterClosed,
    CollectiveTimeout,
    RankError,
    RankResults,
    SendTimeout,
)
from labkit.runtime.results_io import ResultsError, load_results  # noqa: E402
from labkit.runtime.timeouts import Timeouts  # noqa: E402

# for the layers above (the CLI, the checks, the ledgers)
from labkit.runtime.backend import gpu_count, resolve_backend  # noqa: E402
from labkit.runtime.launch import launch_torchrun  # noqa: E402
from labkit.runtime.flight import Entry, GroupLog, find_mismatch, read_recorder  # noqa: E402
from labkit.runtime.platform import available_starts  # noqa: E402
from labkit.runtime.results_io import merge_records, read_records  # noqa: E402
from labkit.runtime.status import innermost_users, line_of  # noqa: E402

__all__ = ["CallInterrupted", "Cluster", "ClusterClosed", "CollectiveTimeout",
           "RankError", "RankResults", "ResultsError", "SendTimeout", "Timeouts",
           "default_cluster", "load_results", "progress", "run"]
__all__ += ["available_starts", "gpu_count", "innermost_users", "launch_torchrun",
            "line_of", "merge_records", "read_records", "resolve_backend"]
# each rank's flight recorder, and what the ranks' records disagree on
__all__ += ["Entry", "GroupLog", "find_mismatch", "read_recorder"]
