"""Keep MindFormers' and MindSpore's side files (logs, IR dumps) out of the working tree during tests."""
import os
import tempfile

os.environ.setdefault("LOG_MF_PATH", os.path.join(tempfile.gettempdir(), "telechat_tests_mindformers_log"))
os.environ.setdefault("GLOG_v", "3")

import mindspore  # noqa: E402

# Fix the device before any kernel runs, so tests that set it again (to the same CPU) are accepted in any order.
mindspore.set_device("CPU")
