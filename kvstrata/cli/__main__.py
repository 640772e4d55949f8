from kvstrata.cli.commands import main

raise SystemExit(main())
