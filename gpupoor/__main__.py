from gpupoor.cli import main

main()
