"""`python -m benchmarks.serve`: the benchmark in benchmarks/serve/run.py."""

from benchmarks.serve.run import main

raise SystemExit(main())
