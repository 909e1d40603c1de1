"""`python -m benchmarks.scaling`: the benchmark in benchmarks/scaling/run.py."""

from benchmarks.scaling.run import main

raise SystemExit(main())
