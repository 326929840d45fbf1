from shardfeed.cli import main

raise SystemExit(main())
