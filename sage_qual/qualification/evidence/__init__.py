"""What a run stores, typed: report.json's records, the worker protocol, and the file itself."""
