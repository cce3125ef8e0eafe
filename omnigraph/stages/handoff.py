"""Stage-to-stage handoff functions usable as `custom_process_input_func`.

A handoff function receives the outputs of the stage's `input_sources` (stage id -> tensors) and
the work item that entered the pipeline, and returns `{"tensors": {...}}`: the next stage's
inputs. The engine checks those tensors against the inputs the next bundle declares.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def outputs_as_inputs(
    source_outputs: Mapping[int, Mapping[str, np.ndarray]],
    entry_inputs: Mapping[str, np.ndarray],
) -> dict[str, dict[str, np.ndarray]]:
    """The default: the source stage's outputs become the next stage's inputs, by name."""
    (outputs,) = source_outputs.values()
    return {"tensors": dict(outputs)}
