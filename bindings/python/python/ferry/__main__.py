"""``python -m ferry``: what this build can do here (``ferry.capabilities()``), as JSON."""

import json

import ferry

print(json.dumps(ferry.capabilities(), indent=2))
