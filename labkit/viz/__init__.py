"""Layer 4, pictures: data in, matplotlib Figure out; widgets bind controls to them.

May import the layers below (theory, ledger, comm, parallel). Each chart takes plain
data and an optional `ax`, draws only there, and returns a Figure without touching
pyplot or rcParams; a widget only binds controls to a chart.

    from labkit import viz
    viz.memory_by_rank([m.current for m in mem]); viz.traffic_by_rank(sent)
    viz.zero_explorer()
"""

from labkit.viz.chooser import (
    StrategyChooser,
    gemm_roofline,
    step_time_bars,
    strategy_chooser,
)
from labkit.viz.diagrams import (
    collective_diagram,
    ring_grid,
    ring_panels,
    traffic_by_collective,
)
from labkit.viz.dp_charts import dp_timeline, dp_timelines, dp_traffic
from labkit.viz.ledger_charts import memory_by_rank, timeline_by_rank, traffic_by_rank
from labkit.viz.network_charts import (
    bandwidth_chart,
    hierarchy,
    hierarchy_table,
    link_load,
)
from labkit.viz.failure_charts import bytes_per_step, loss_curves, waste_curve
from labkit.viz.pipeline_charts import (
    bubble_vs_m,
    pipeline_timeline,
    pipeline_timelines,
    schedule_timeline,
    schedule_timelines,
)
from labkit.viz.sp_charts import activation_bars, ring_steps_chart
from labkit.viz.style import CATEGORY_COLORS, OP_COLORS, PAGE_WIDTH_IN, LabFigure
from labkit.viz.tables import Comparison, Prose, Row, measured_vs_expected, prose
from labkit.viz.theory_charts import (
    activation_chart,
    flops_by_length,
    placement_bars,
    zero_bars,
)
from labkit.viz.widgets import (
    LIVE_CLASS,
    PlacementExplorer,
    RingStepper,
    ZeroExplorer,
    placement_explorer,
    ring_stepper,
    zero_explorer,
)
from labkit.viz.zero_charts import stage_bars, steward_grid, steward_grids

__all__ = [
    "CATEGORY_COLORS", "OP_COLORS", "Comparison", "LabFigure", "PlacementExplorer",
    "RingStepper", "Row", "ZeroExplorer", "bandwidth_chart", "collective_diagram",
    "hierarchy", "link_load", "measured_vs_expected", "memory_by_rank",
    "placement_bars", "placement_explorer", "ring_grid", "ring_stepper",
    "timeline_by_rank",
    "traffic_by_rank", "zero_bars", "zero_explorer",
]

__all__ += ["dp_timeline", "dp_timelines", "dp_traffic"]
__all__ += ["stage_bars", "steward_grid", "steward_grids"]
__all__ += ["activation_bars", "activation_chart", "hierarchy_table", "ring_panels",
            "ring_steps_chart", "traffic_by_collective"]
__all__ += ["StrategyChooser", "gemm_roofline", "step_time_bars", "strategy_chooser"]
__all__ += ["Prose", "prose"]
__all__ += ["bubble_vs_m", "pipeline_timeline", "pipeline_timelines",
            "schedule_timeline", "schedule_timelines"]
__all__ += ["bytes_per_step", "loss_curves", "waste_curve"]
# what the built pages are laid out for: the column a chart fits, the controls
# that work with no kernel (labkit.cli.page_assets)
__all__ += ["LIVE_CLASS", "PAGE_WIDTH_IN"]
__all__ += ["flops_by_length"]  # FLOPs per token by MFU convention (chapter 14)
