import sys

if sys.argv[1:2] == ["check"]:
    from agents.check import main as check

    sys.exit(check(sys.argv[2:]))

from agents.cli import main

sys.exit(main())
