from rollfleet.cli import main

main()
