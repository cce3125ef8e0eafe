"""What every System One decision model shares, so no model folder imports another's.

- `request`: the Decision API's request (``{"model"?, "state", "questions"}``) validated whole
  into typed questions (`parse_request`, `RequestLimits`, `Question`, `DecisionRequest`);
- `decoding`: a question's typed answer from its option probabilities, and the response;
- `corpus`: the generated corpus the synthetic checkpoints' tokenizers are trained on;
- `qwen3_synth`: tiny random Qwen3 checkpoints, the backbone of the Qwen-based models' tests
  (Cua-S1, Open-Jev).

The model folders (`laya/`, `cua_s1/`, `open_jev/`) import from here and never from each other.
"""
