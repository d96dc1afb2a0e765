"""``python -m outrider.daemon.cli``: the ``outrider`` command."""

from outrider.daemon.cli.main import main

raise SystemExit(main())
