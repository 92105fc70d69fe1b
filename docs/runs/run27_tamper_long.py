"""Run 27 probe (issue 28): a report whose long checks' budgets were loosened by hand.

Reads a certify report, multiplies every error limit of each sm90-fp8-cuda long check by 100 (the
cosine's and norm ratios' distance from 1 likewise), and writes the edited copy: `gate` must refuse
it, where it takes the untouched report.
Usage: python run27_tamper_long.py REPORT.json OUT.json"""

import json
import sys

data = json.loads(open(sys.argv[1]).read())
edited = 0
for device in data["devices"]:
    for check in device.get("long") or []:
        if check["variant"] == "sm90-fp8-cuda" and check.get("bounds"):
            check["bounds"] = {name: (1 - (1 - value) * 100 if name in ("min_cosine", "min_norm_ratio")
                                      else 1 + (value - 1) * 100 if name == "max_norm_ratio" else value * 100)
                               for name, value in check["bounds"].items() if value is not None}
            edited += 1
open(sys.argv[2], "w").write(json.dumps(data))
print(f"loosened the budgets of {edited} sm90-fp8-cuda long checks")
