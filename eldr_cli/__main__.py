from eldr_cli.app import main

main()
