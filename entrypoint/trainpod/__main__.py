from trainpod.cli import main

raise SystemExit(main())
