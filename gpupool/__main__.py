from gpupool.cli.main import main

main()
