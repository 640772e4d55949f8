from kvstrata.cli.main import main

raise SystemExit(main())
