//! The `nmt` binary: parse the command line and dispatch; errors become one line on stderr.

use clap::Parser;
use nmt::cli::{Cli, Command};
use nmt::commands;
use nmt::runtime::{keep_freed_memory, on_worker, one_candle_pool_thread};

fn main() {
    keep_freed_memory();
    one_candle_pool_thread();
    let cli = Cli::parse();
    let result = on_worker(move || match cli.command {
        Command::Tokenize(cmd) => commands::tokenize(cmd).map(|()| 0),
        Command::Prepare(args) => commands::prepare(args).map(|()| 0),
        Command::Train(args) => commands::train(*args),
        Command::Translate(args) => commands::translate(args).map(|()| 0),
        Command::Average(args) => commands::average(args).map(|()| 0),
        Command::Eval(args) => commands::eval(args).map(|()| 0),
    });
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
