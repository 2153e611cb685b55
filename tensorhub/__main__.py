from tensorhub.tools.cli import main

raise SystemExit(main())
