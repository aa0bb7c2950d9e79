import os
import sys

# reuse the core tests' random batch generator (tests/core/batches.py: random_case, rel_err)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core"))
