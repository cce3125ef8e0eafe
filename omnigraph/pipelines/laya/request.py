"""The old path of `omnigraph.pipelines.system_one.request`, the Decision API's request parser.

Kept only for tests/reliability/test_http_limits.py until it imports the new path; import
`omnigraph.pipelines.system_one.request` instead. Delete this file once nothing imports it.
"""

from omnigraph.pipelines.system_one.request import *  # noqa: F403
from omnigraph.pipelines.system_one.request import __all__  # noqa: F401
